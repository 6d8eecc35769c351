"""Entry point of the engine-core child: ``python -m trio_llm.engine --ipc-fd N --parent-pid P``.

Before anything else the child asks the kernel to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux) and ignores SIGINT: a Ctrl-C reaches the whole
terminal process group, and the server decides the order of shutdown. The child also
exits when the IPC socket reaches end-of-file.

It also sets torch's OpenMP threads to stop spinning soon when they wait (see
`OPENMP_SPIN_DEFAULTS`), unless the environment already says how they should wait.
"""

from __future__ import annotations

import os
import sys

from trio_llm.parent_death import start_child

#: Set in the engine child before torch (and its libgomp) loads, where the environment
#: has neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``. libgomp's default lets a
#: waiting thread spin 300,000 times before it sleeps, which keeps a core busy while the
#: thread it waits for is descheduled by another process: beside a one-core hog on 2
#: cores the engine ran 3x slower, 1.3-2.6x with this (bench/contention.py,
#: docs/benchmarks.md; ``--num-threads auto``, `trio_llm.engine.cpu_share`, does
#: better). Fewer spins cost a batch-1 decode step its threads' wake-ups (5,000: up to
#: 2x slower, 3,000: 3x; 10,000 and more: unchanged).
OPENMP_SPIN_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def _openmp_defaults(environ: dict[str, str] | os._Environ[str]) -> None:
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ.update(OPENMP_SPIN_DEFAULTS)


def main() -> None:
    _openmp_defaults(os.environ)
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
