"""Work that outlives the request that started it (background responses), each a task in
a nursery the supervisor owns: never fire-and-forget.

The supervisor runs `BackgroundRuns.serve` in its engines' nursery once the server is
ready, and calls `BackgroundRuns.stop` when it shuts down, before the engine stops: the
tasks still running are cancelled then (a background response is left ``in_progress``
in the store, to run again at the next start) rather than failed by the engine's stop.
A SIGTERM drain waits for them as for any request, since their engine requests count as
in flight. Each task is known by a key (the response id), so that a request can cancel
it and wait until it has ended (`cancel`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

logger = logging.getLogger(__name__)

#: A background task: it runs what ``scope`` may cancel inside it, and may write its
#: result after leaving it.
Work = Callable[[trio.CancelScope], Awaitable[None]]


class BackgroundRuns:
    """The server's background tasks (see the module doc)."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        self._ended: dict[str, trio.Event] = {}

    @property
    def running(self) -> bool:
        """Whether tasks can be started (`serve` runs and was not stopped)."""
        return self._nursery is not None and not self._nursery.cancel_scope.cancel_called

    def __contains__(self, key: str) -> bool:
        return key in self._scopes

    def __len__(self) -> int:
        """The tasks started and not ended yet."""
        return len(self._scopes)

    async def serve(
        self,
        at_start: Callable[[], Awaitable[None]] | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Own the background tasks until `stop` (or a cancellation); run ``at_start``
        (resuming what a stopped server left) as the first of them."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                if at_start is not None:
                    nursery.start_soon(self._guarded, "resume", at_start)
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def stop(self) -> None:
        """Cancel every background task and end `serve` (idempotent)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def start(self, key: str, work: Work) -> None:
        """Run ``work`` as the task ``key`` with a cancel scope `cancel` cancels.

        Raises:
            RuntimeError: no task can start (`running` is False).
        """
        if self._nursery is None or not self.running:
            raise RuntimeError("background tasks are not running (the server is stopping)")
        scope = self._scopes[key] = trio.CancelScope()
        self._ended[key] = trio.Event()
        self._nursery.start_soon(self._run, key, work, scope)

    async def cancel(self, key: str) -> bool:
        """Cancel task ``key``'s scope and wait until the task has ended; False if no
        such task runs here."""
        scope = self._scopes.get(key)
        if scope is None:
            return False
        ended = self._ended[key]
        scope.cancel()
        await ended.wait()
        return True

    async def _run(self, key: str, work: Work, scope: trio.CancelScope) -> None:
        try:
            await self._guarded(key, lambda: work(scope))
        finally:
            del self._scopes[key]
            self._ended.pop(key).set()

    @staticmethod
    async def _guarded(key: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work``; a bug in one task is logged, never the server's end."""
        try:
            await work()
        except Exception:
            logger.exception(f"background task {key} failed")
