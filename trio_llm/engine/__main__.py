"""Entry point of the engine-core child: ``python -m trio_llm.engine --ipc-fd N --parent-pid P``.

Before anything else the child asks the kernel to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux) and ignores SIGINT: a Ctrl-C reaches the whole
terminal process group, and the server decides the order of shutdown. The child also
exits when the IPC socket reaches end-of-file.
"""

from __future__ import annotations

import os
import sys

from trio_llm.parent_death import start_child


def main() -> None:
    args = start_child("python -m trio_llm.engine", "--ipc-fd")

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
