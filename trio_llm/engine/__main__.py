"""Entry point of the engine-core child: ``python -m trio_llm.engine --ipc-fd N --parent-pid P``.

Before anything else the child asks the kernel to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux) and ignores SIGINT: a Ctrl-C reaches the whole
terminal process group, and the server decides the order of shutdown. The child also
exits when the IPC socket reaches end-of-file.
"""

from __future__ import annotations

import argparse
import os
import sys

from trio_llm.logging_setup import configure_logging
from trio_llm.parent_death import guard_child


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trio_llm.engine")
    parser.add_argument("--ipc-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    guard_child(args.parent_pid)
    configure_logging()  # the level the server chose, from $TRIO_LLM_LOG_LEVEL

    import trio

    from trio_llm.engine.loop import run_engine_core
    from trio_llm.ipc import socket_stream_from_fd

    async def run() -> int:
        return await run_engine_core(socket_stream_from_fd(args.ipc_fd))

    code = trio.run(run)
    # Skip the interpreter's teardown (seconds once torch is imported): nothing is left to
    # clean up, the server is waiting to reap us, and the kernel frees the memory.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
