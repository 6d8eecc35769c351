"""Entry point of the detokenizer child (3-process mode).

    python -m trio_llm.detokenizer --api-fd N --engine-fd M --parent-pid P

``--api-fd`` is the socket to the API server, ``--engine-fd`` the socket to the engine
core (both started by the same server nursery). Like the engine core, the child dies with
its parent (``PR_SET_PDEATHSIG``), ignores SIGINT, and exits at end-of-file of either
socket.
"""

from __future__ import annotations

import sys

from trio_llm.parent_death import start_child


def main() -> None:
    args = start_child("python -m trio_llm.detokenizer", "--api-fd", "--engine-fd")

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
