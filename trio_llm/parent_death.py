"""What every child process does first: die with its parent, leave Ctrl-C to it.

Both children (the engine core and the detokenizer) call `start_child` (which calls
`guard_child`) before importing
anything heavy: the kernel then SIGKILLs them when the API server dies
(``prctl(PR_SET_PDEATHSIG)``, Linux), and SIGINT is ignored because a Ctrl-C reaches the
whole terminal process group while the server decides the order of shutdown.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

from trio_llm.logging_setup import configure_logging

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the parent exits; exit now if it already has.

    Raises:
        OSError: ``prctl`` failed.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        # The parent died before prctl took effect; nobody would reap or stop us.
        os._exit(1)


def guard_child(parent_pid: int) -> None:
    """`die_with_parent`, then ignore SIGINT."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_child(prog: str, *fd_options: str) -> argparse.Namespace:
    """A child's first steps: parse ``--parent-pid`` and the socket descriptors named by
    ``fd_options`` (e.g. ``"--ipc-fd"``: integers, all required), `guard_child`, then
    configure logging at the level the server chose (``$TRIO_LLM_LOG_LEVEL``).

    Returns:
        The parsed arguments (``args.ipc_fd``, ``args.parent_pid``, ...).

    Raises:
        SystemExit: missing or malformed arguments (argparse's exit status 2).
    """
    parser = argparse.ArgumentParser(prog=prog)
    for option in fd_options:
        parser.add_argument(option, type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    # Only shown by ps: which of the server's data-parallel engines this child serves.
    parser.add_argument("--data-parallel-rank", type=int, default=None)
    # Likewise: which model, on a server of several models.
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args()
    guard_child(args.parent_pid)
    configure_logging()
    return args
