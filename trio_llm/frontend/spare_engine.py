"""An engine-core child started ahead of need, for servers that load models on demand.

A model loaded on demand (a server of several models, ``--max-loaded-models``,
``--keep-alive``) used to pay for a whole new ``python -m trio_llm.engine`` before its
first token: about 3.5 s of imports (torch, transformers, the engine) on 2 cores, before
the child even read its `EngineConfig`. The child does nothing model-specific until that
first frame, so one can be started early and kept waiting:

    async with trio.open_nursery() as nursery:
        spare = SpareEngine()
        nursery.start_soon(spare.run)
        nursery.start_soon(serve_a_model, spare)  # calls spare.install() first; its
        ...                                       # engines take the spare when one waits
        spare.close()

`trio_llm.frontend.engine_process` asks `take_spare` for a child (single engine, inline
detokenizer: the spare's command line names no rank and no model); it replaces the spare
once an engine is ready (`replenish`: the first spare after the default model's, the
next after the engine that took it), so a spare's imports never compete with a model's
load. The spare is this task's child: the task's end (the
server stopping, a cancellation) kills and reaps it; a spare that dies by itself is
reaped, logged, and not replaced (one start per replenish, never a loop). An idle spare
costs its imports' memory (about 0.4 GB) and no CPU.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

import trio

from trio_llm.frontend.child_process import ChildProcess

if TYPE_CHECKING:
    from trio_llm.server_config import ServerConfig

logger = logging.getLogger(__name__)

_current: contextvars.ContextVar[SpareEngine | None] = contextvars.ContextVar(
    "trio_llm_spare_engine", default=None
)


def engine_command(fd: int) -> list[str]:
    """The engine child's command line, its IPC socket on file descriptor ``fd``."""
    return [
        sys.executable,
        "-m",
        "trio_llm.engine",
        "--ipc-fd",
        str(fd),
        "--parent-pid",
        str(os.getpid()),
    ]


def spare_wanted(config: ServerConfig) -> bool:
    """Whether a server of ``config`` loads models on demand (several models, or
    ``--keep-alive``) through engines that can take a spare (one engine per model, the
    inline detokenizer)."""
    on_demand = config.models.several or config.models.keep_alive is not None
    return on_demand and config.data_parallel_size == 1 and config.detokenizer_mode == "inline"


class SpareEngine:
    """Keeps at most one engine child waiting for its config (see the module's text)."""

    def __init__(self) -> None:
        self._spare: tuple[socket.socket, ChildProcess] | None = None
        self._wanted = trio.Event()
        self._watch = trio.CancelScope()
        self._scope = trio.CancelScope()

    def install(self) -> None:
        """Engines started by the calling task (and the tasks it starts later) may take the
        spare: a Trio task runs in its own copy of the context, so this lasts as long as
        the calling task."""
        _current.set(self)

    def take(self) -> tuple[socket.socket, ChildProcess] | None:
        """The waiting child and the server's end of its socket, or None (none ready)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        # Stop watching it now (synchronously: its new owner may wait on it at once).
        self._watch.cancel()
        if spare[1].returncode is not None:
            spare[0].close()
            return None
        return spare

    def replenish(self) -> None:
        """Start the next spare (the engine that took the last one is ready)."""
        self._wanted.set()

    def close(self) -> None:
        """End `run` (its spare is killed and reaped)."""
        self._scope.cancel()

    async def run(self) -> None:
        """Keep a spare until `close` or a cancellation; kill and reap the one left."""
        with self._scope:
            await self._keep()

    async def _keep(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if self._spare is not None:
                continue
            server_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                process = ChildProcess(
                    engine_command(child_end.fileno()), pass_fds=(child_end.fileno(),)
                )
            except OSError as exc:
                server_end.close()
                logger.warning(f"no spare engine child: {exc}")
                return
            finally:
                child_end.close()
            self._spare = (server_end, process)
            try:
                with trio.CancelScope() as self._watch:
                    code = await process.wait()
                    logger.warning(f"the spare engine child exited by itself (status {code})")
            finally:
                if self._spare is not None and self._spare[1] is process:
                    self._spare = None
                    server_end.close()  # the child exits at end-of-file
                    with trio.CancelScope(shield=True):
                        process.kill()
                        await process.wait()


def take_spare() -> tuple[socket.socket, ChildProcess] | None:
    """The current context's spare child (`SpareEngine.take`), or None."""
    keeper = _current.get()
    return None if keeper is None else keeper.take()


def replenish_spare() -> None:
    """An engine is ready: the current context's keeper (if any) starts its next spare."""
    keeper = _current.get()
    if keeper is not None:
        keeper.replenish()
