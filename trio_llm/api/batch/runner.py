"""The batch runner: runs every batch that is not over, a few lines at a time, each
through the server's own request path (`trio_llm.api.batch.line_runner.LineRunner`).

One `BatchRunner` per server, a task of the server's root nursery (`run_until`: started
once the HTTP app is built, cancelled when the server stops). It finds the batches that
are not over in the store (at start-up too: those a killed server left are resumed),
takes those no other running server runs (replicas on one store share the batches,
`trio_llm.store.runners`), and drives each: validate its input file, run its lines
(at most ``max_in_flight`` lines of all batches at once), record each line's result in
its own transaction, then write the output and error files (`trio_llm.store.batches`).
A line is recorded once: lines recorded before a crash are not run again, the others run
once.

A store that cannot be written (locked, a full disk) or an engine that stopped ends the
batch's work for now; it is tried again later (`POLL_INTERVAL`), never a crash of the
server. Any other error in one line is that line's result (``internal_error`` in the
error file; `trio_llm.api.batch.line_runner.run_line`), and the batch goes on; one outside the
lines fails the batch (``internal_error`` in its ``errors``, the details in the log).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import trio
from starlette.types import ASGIApp

from trio_llm.api.batch.line_runner import (
    LineRunner,
    Wakeup,
    api_key_headers,
    failed_line,
    run_line,
)
from trio_llm.api.batch.lines import InputLines, check_input, error_line, parse_line
from trio_llm.errors import EngineError
from trio_llm.frontend.handle import EngineState
from trio_llm.store import Store, StoreError, StoreUnavailable
from trio_llm.store import batches as stored
from trio_llm.store.files import content_path, remove_orphans
from trio_llm.store.objects import now

logger = logging.getLogger(__name__)

#: Seconds between two looks for batches (another server's, on a shared store) and for
#: a cancel of a running batch, besides the wake-ups of this server's own routes.
POLL_INTERVAL = 5.0
STATUS_INTERVAL = 2.0
#: Tries of one line's record before the batch's work stops (tried again later), and
#: the seconds before the second (doubling after).
RECORD_TRIES = 5
RECORD_RETRY = 0.5


class BatchRunner:
    """Runs the store's batches through ``app``.

    Args:
        app: the server's ASGI app (lines run through it, in this process).
        engine: the engines behind it (`trio_llm.frontend.handle.EngineState`).
        store: the server's store.
        max_in_flight: most lines (of all batches) running at once.
        api_key: the server's API key (lines carry it), or None.
        max_waiting: the server's ``--max-num-waiting-requests`` (`LineRunner`).
    """

    def __init__(
        self,
        app: ASGIApp,
        engine: EngineState,
        store: Store,
        *,
        max_in_flight: int,
        api_key: str | None = None,
        max_waiting: int | None = None,
    ) -> None:
        self.store = store
        self.lines = LineRunner(app, engine, api_key_headers(api_key), max_waiting)
        self.slots = trio.Semaphore(max_in_flight)
        self.wakeup = Wakeup()
        self._running: set[str] = set()

    def wake(self) -> None:
        """A batch was created or cancelled: look at the store now."""
        self.wakeup.set()

    async def run_until(self, stop: trio.Event) -> None:
        """`run` until ``stop`` is set (lines in flight are abandoned: they run again at
        the next start)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run)
            await stop.wait()
            nursery.cancel_scope.cancel()

    async def run(self) -> None:
        """Drive every batch that is not over and that no other running server runs
        (`trio_llm.store.batches.claim_batches`), until cancelled."""
        try:
            await self.store.transaction(partial(remove_orphans, files_dir=self.store.files_dir))
        except (StoreError, OSError) as exc:
            logger.warning(f"batches: could not look for orphaned files: {exc}")
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    claim = partial(stored.claim_batches, me=self.store.runner)
                    active = await self.store.transaction(claim)
                except StoreError as exc:
                    logger.warning(f"batches: cannot read the store: {exc}")
                    active = []
                for batch in active:
                    if batch["id"] not in self._running:
                        self._running.add(batch["id"])
                        nursery.start_soon(self._guarded, batch["id"])
                await self.wakeup.wait(POLL_INTERVAL)

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self._drive(batch_id)
        except Exception as exc:
            if is_transient(exc):
                logger.warning(f"batch {batch_id}: stopped for now, tried again later: {exc!r}")
                return
            logger.exception(f"batch {batch_id} failed")
            message = "an internal error stopped the batch (in the server's log)"
            error = {"code": "internal_error", "message": message, "param": None, "line": None}
            await self._fail(batch_id, [error])
        finally:
            self._running.discard(batch_id)

    async def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        try:
            await self.store.transaction(
                partial(stored.fail_batch, batch_id=batch_id, errors=errors, only_from=_ACTIVE)
            )
        except StoreError as exc:
            logger.warning(f"batch {batch_id}: cannot record its failure: {exc}")

    async def _drive(self, batch_id: str) -> None:
        """Take one batch from wherever it stands to its end."""
        batch = await self.store.transaction(partial(stored.get_batch, batch_id=batch_id))
        path = content_path(self.store.files_dir, batch["input_file_id"])
        if batch["status"] in ("validating", "in_progress") and not path.exists():
            message = f"the contents of the input file '{batch['input_file_id']}' are gone"
            error = {"code": "input_file_missing", "message": message}
            await self._fail(batch_id, [{**error, "param": "input_file_id", "line": None}])
            return
        if batch["status"] == "validating":
            total, errors = await trio.to_thread.run_sync(check_input, path)
            if errors:
                validated = partial(stored.fail_batch, batch_id=batch_id, errors=errors)
            else:
                validated = partial(stored.start_batch, batch_id=batch_id, total=total)
            await self.store.transaction(validated)  # unless cancelled meanwhile
            batch = await self.store.transaction(partial(stored.get_batch, batch_id=batch_id))
        ending = None
        if batch["status"] == "in_progress":
            ending = await self._run_lines(batch)
        if ending == "complete":
            await self.store.transaction(partial(stored.begin_finalizing, batch_id=batch_id))
        status = await self.store.transaction(partial(stored.batch_status, batch_id=batch_id))
        if status == "finalizing":
            await self._finish(batch_id, "completed")
        elif status == "cancelling":
            await self._finish(batch_id, "cancelled")
        elif status == "in_progress" and ending == "expire":
            await self._finish(batch_id, "expired")

    async def _finish(self, batch_id: str, status: str) -> None:
        """Write the result files and end the batch with ``status``."""
        files = await trio.to_thread.run_sync(
            stored.write_result_files, self.store.transaction_sync, self.store.files_dir, batch_id
        )
        max_age = self.store.policy.max_age
        expires_at = None if max_age is None else now() + int(max_age)
        await self.store.transaction(
            partial(
                stored.finish_batch,
                batch_id=batch_id,
                status=status,
                files=files,
                expires_at=expires_at,
            )
        )
        logger.info(f"batch {batch_id} {status}")

    async def _run_lines(self, batch: dict[str, Any]) -> str:
        """Run the lines of ``batch`` that have no result; return why it stopped:
        ``complete`` (every line has one), ``cancel`` or ``expire``."""
        batch_id = batch["id"]
        done = await self.store.transaction(partial(stored.recorded_lines, batch_id=batch_id))
        path = content_path(self.store.files_dir, batch["input_file_id"])
        ending = "complete"
        lines_scope = trio.CancelScope()
        cancelled = trio.Event()
        async with trio.open_nursery() as watch:
            watch.start_soon(self._watch_cancel, batch_id, lines_scope, cancelled)
            with lines_scope:
                async with trio.open_nursery() as running, InputLines(path) as reader:
                    while chunk := await reader.next_chunk():
                        todo = [(index, raw) for index, raw in chunk if index not in done]
                        if todo and now() >= batch["expires_at"]:
                            ending = "expire"
                            break
                        for index, raw in todo:
                            await self.slots.acquire()
                            running.start_soon(self._line, batch, index, raw)
            watch.cancel_scope.cancel()
        if cancelled.is_set():
            return "cancel"
        if ending == "expire":
            await self._expire_rest(batch, path)
        return ending

    async def _line(self, batch: dict[str, Any], index: int, raw: bytes) -> None:
        """Run and record one line. An unexpected error in it (while it runs:
        `run_line`; or in its record) records the line as ``internal_error``: it fails
        that line, never the batch."""
        try:
            parsed = parse_line(index, raw, (batch["endpoint"],))
            ok, result = await run_line(self.lines, parsed)
            try:
                await self._record(batch["id"], index, ok, result)
            except Exception as exc:
                if is_transient(exc):
                    raise
                logger.exception(f"batch {batch['id']}: line {index + 1} not recorded")
                await self._record(batch["id"], index, False, failed_line(parsed.custom_id))
        finally:
            self.slots.release()

    async def _record(self, batch_id: str, index: int, ok: bool, result: str) -> None:
        """Record a line's result, trying again while the database is busy.

        Raises:
            StoreError: the store cannot be written (the batch's work stops for now).
        """
        record = partial(stored.record_result, batch_id=batch_id, line=index, ok=ok, result=result)
        delay = RECORD_RETRY
        for attempt in range(RECORD_TRIES):
            try:
                await self.store.transaction(record)
                return
            except StoreUnavailable as exc:
                if attempt == RECORD_TRIES - 1:
                    raise
                logger.warning(f"batch {batch_id}: recording line {index} failed ({exc}), again")
                await trio.sleep(delay)
                delay *= 2

    async def _watch_cancel(
        self, batch_id: str, lines: trio.CancelScope, cancelled: trio.Event
    ) -> None:
        """Stop the batch's lines once a cancel is recorded (by this server or another)."""
        while True:
            await self.wakeup.wait(STATUS_INTERVAL)
            try:
                status = await self.store.transaction(
                    partial(stored.batch_status, batch_id=batch_id)
                )
            except StoreError as exc:
                logger.warning(f"batch {batch_id}: cannot read its status: {exc}")
                continue
            if status != "in_progress":
                cancelled.set()
                lines.cancel()
                return

    async def _expire_rest(self, batch: dict[str, Any], path: Path) -> None:
        """Record every line without a result as expired (OpenAI's ``batch_expired``)."""
        batch_id = batch["id"]
        done = await self.store.transaction(partial(stored.recorded_lines, batch_id=batch_id))
        message = "the batch expired before this request was run"
        async with InputLines(path) as reader:
            while chunk := await reader.next_chunk():
                for index, raw in chunk:
                    if index in done:
                        continue
                    parsed = parse_line(index, raw, (batch["endpoint"],))
                    result = error_line(parsed.custom_id, "batch_expired", message)
                    await self._record(batch_id, index, False, result)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or every error of an exception group) is one that passes: the
    store cannot be used now, the disk is full or failing, no engine serves."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(inner) for inner in exc.exceptions)
    return isinstance(exc, (StoreError, OSError, EngineError))


#: Statuses a batch can be failed from by an unexpected error.
_ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
