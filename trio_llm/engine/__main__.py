"""Entry point of the engine-core child: ``python -m trio_llm.engine --ipc-fd N --parent-pid P``.

Before anything else the child asks the kernel to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux) and ignores SIGINT: a Ctrl-C reaches the whole
terminal process group, and the server decides the order of shutdown. The child also
exits when the IPC socket reaches end-of-file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the parent exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        # The parent died before prctl took effect; nobody would reap or stop us.
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trio_llm.engine")
    parser.add_argument("--ipc-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import trio

    from trio_llm.engine.loop import run_engine_core
    from trio_llm.ipc import socket_stream_from_fd

    async def run() -> int:
        return await run_engine_core(socket_stream_from_fd(args.ipc_fd))

    sys.exit(trio.run(run))


if __name__ == "__main__":
    main()
