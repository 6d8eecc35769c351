"""Entry point of the detokenizer child (3-process mode).

    python -m trio_llm.detokenizer --api-fd N --engine-fd M --parent-pid P

``--api-fd`` is the socket to the API server, ``--engine-fd`` the socket to the engine
core (both started by the same server nursery). Like the engine core, the child dies with
its parent (``PR_SET_PDEATHSIG``), ignores SIGINT, and exits at end-of-file of either
socket.
"""

from __future__ import annotations

import argparse
import sys

from trio_llm.logging_setup import configure_logging
from trio_llm.parent_death import guard_child


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trio_llm.detokenizer")
    parser.add_argument("--api-fd", type=int, required=True)
    parser.add_argument("--engine-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    guard_child(args.parent_pid)
    configure_logging()  # the level the server chose, from $TRIO_LLM_LOG_LEVEL

    import trio

    from trio_llm.detokenizer.process import run_detokenizer
    from trio_llm.ipc import socket_stream_from_fd

    async def run() -> int:
        return await run_detokenizer(
            socket_stream_from_fd(args.api_fd), socket_stream_from_fd(args.engine_fd)
        )

    sys.exit(trio.run(run))


if __name__ == "__main__":
    main()
