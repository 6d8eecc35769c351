"""Batches (``/v1/batches``): the batch objects and each line's recorded result.

A batch is OpenAI's Batch object, kept whole as JSON (column ``body``, its ``status`` also
in a column). Its life: ``validating`` (the input file is checked) -> ``in_progress``
(lines run) -> ``finalizing`` (the output and error files are written) -> ``completed``;
or ``failed`` (the input file is unusable: ``errors`` says why, line by line), or
``cancelling`` -> ``cancelled``, or ``expired`` (its completion window passed).

Each line's result is recorded once, in its own transaction, keyed by ``(batch, line)``
(`record_result`: ``ON CONFLICT DO NOTHING``): a line run again after a crash is never
recorded twice. While a batch runs, its ``request_counts`` are counted from those rows;
`finish_batch` freezes them into the object, registers the output and error files and
drops the rows (the files hold them) in one transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from trio_llm.store.database import StoreError, Transaction
from trio_llm.store.files import BATCH_OUTPUT, FileWriter, get_file, insert_file
from trio_llm.store.objects import Page, dumps, loads, missing, new_ordered_id, now
from trio_llm.store.retention import ACTIVE_BATCH
from trio_llm.store.runners import Runner, live, runner_is

#: The endpoints a batch may run (OpenAI's, those this server serves).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: Completion windows by name, in seconds (OpenAI offers one).
COMPLETION_WINDOWS = {"24h": 86400}
#: Statuses of a batch that is over.
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
#: The timestamp set when a batch reaches each status.
_STATUS_TIMES = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}
#: A batch's two result files.
KINDS = ("output", "error")
#: Namespace of the ids of a batch's output and error files (`output_file_id`).
_FILE_NAMESPACE = uuid.UUID("5e0c3d52-6f7a-4b8e-9a43-74726f6c6c6d")


class BatchConflict(StoreError):
    """The batch is not in a status that allows this (cancelling a finished batch; a
    batch input file of the wrong purpose). ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_batch_id() -> str:
    """A new batch id (``batch_`` and 32 hex digits, in creation order)."""
    return new_ordered_id("batch_")


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``error`` file: the same on every try, so that a
    batch finalized again after a crash writes and registers the same files."""
    return "file-" + uuid.uuid5(_FILE_NAMESPACE, f"{batch_id}/{kind}").hex


def create_batch(
    tx: Transaction,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    at: int | None = None,
) -> dict[str, Any]:
    """Store a new batch in ``validating``; return its object.

    Raises:
        NotFound: the input file is not stored.
        BatchConflict: the input file's purpose is not ``batch``.
        ValueError: an endpoint or completion window this server does not know.
    """
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown batch endpoint {endpoint!r}")
    window = COMPLETION_WINDOWS[completion_window]
    source = get_file(tx, input_file_id)
    if source["purpose"] != "batch":
        raise BatchConflict(
            f"the file '{input_file_id}' has purpose '{source['purpose']}'; a batch's "
            "input file must be uploaded with purpose 'batch'",
            "input_file_id",
        )
    created = now() if at is None else at
    batch: dict[str, Any] = {
        "id": new_batch_id(),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + window,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }
    tx.execute(
        "INSERT INTO batches (id, created_at, status, body) VALUES (?, ?, ?, ?)",
        (batch["id"], created, "validating", dumps(batch)),
    )
    return batch


def _load(tx: Transaction, batch_id: str) -> dict[str, Any]:
    row = tx.one("SELECT body FROM batches WHERE id = ?", (batch_id,))
    if row is None:
        raise missing(tx, "batch", batch_id)
    return loads(row[0])


def _save(tx: Transaction, batch: dict[str, Any]) -> None:
    tx.execute(
        "UPDATE batches SET status = ?, body = ? WHERE id = ?",
        (batch["status"], dumps(batch), batch["id"]),
    )


def _set_status(batch: dict[str, Any], status: str, at: int | None) -> None:
    batch["status"] = status
    batch[_STATUS_TIMES[status]] = now() if at is None else at


def result_counts(tx: Transaction, batch_id: str) -> tuple[int, int]:
    """``(completed, failed)``: the lines of ``batch_id`` recorded so far, by outcome."""
    row = tx.one(
        "SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM batch_results WHERE batch_id = ?", (batch_id,)
    )
    completed, recorded = (int(row[0]), int(row[1])) if row is not None else (0, 0)
    return completed, recorded - completed


def _with_counts(tx: Transaction, batch: dict[str, Any]) -> dict[str, Any]:
    if batch["status"] in ACTIVE_BATCH:
        completed, failed = result_counts(tx, batch["id"])
        batch["request_counts"] = {**batch["request_counts"], "completed": completed}
        batch["request_counts"]["failed"] = failed
    return batch


def get_batch(tx: Transaction, batch_id: str) -> dict[str, Any]:
    """The Batch object of ``batch_id``, its ``request_counts`` up to date.

    Raises:
        NotFound: no such batch (`Evicted` when the retention removed it).
    """
    return _with_counts(tx, _load(tx, batch_id))


def list_batches(tx: Transaction, *, limit: int, after: str | None, order: str = "desc") -> Page:
    """A page of Batch objects, newest first (the Batch API has no other ``order``),
    following the batch ``after``.

    Raises:
        NotFound: ``after`` is not a stored batch.
    """
    where, params = "", []
    if after is not None:
        row = tx.one("SELECT created_at FROM batches WHERE id = ?", (after,))
        if row is None:
            raise missing(tx, "batch", after)
        where = "WHERE created_at < ? OR (created_at = ? AND id < ?) "
        params = [row[0], row[0], after]
    rows = tx.rows(
        f"SELECT body FROM batches {where}ORDER BY created_at DESC, id DESC LIMIT ?",
        (*params, limit + 1),
    )
    return Page([_with_counts(tx, loads(row[0])) for row in rows[:limit]], len(rows) > limit)


def request_cancel(tx: Transaction, batch_id: str, at: int | None = None) -> dict[str, Any]:
    """Move a validating or running batch to ``cancelling`` (the runner then stops it);
    a batch already cancelling is returned as it is.

    Raises:
        NotFound: no such batch.
        BatchConflict: the batch is finalizing or over.
    """
    batch = _load(tx, batch_id)
    if batch["status"] in ("validating", "in_progress"):
        _set_status(batch, "cancelling", at)
        _save(tx, batch)
    elif batch["status"] != "cancelling":
        raise BatchConflict(f"the batch '{batch_id}' is {batch['status']}: it cannot be cancelled")
    return _with_counts(tx, batch)


def active_batches(tx: Transaction) -> list[dict[str, Any]]:
    """Every batch not over yet (validating, running, finalizing, cancelling), oldest
    first."""
    marks = ",".join("?" * len(ACTIVE_BATCH))
    rows = tx.rows(
        f"SELECT body FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", ACTIVE_BATCH
    )
    return [loads(row[0]) for row in rows]


def claim_batches(tx: Transaction, me: Runner) -> list[dict[str, Any]]:
    """The batches not over yet that ``me`` runs, oldest first: those it ran already,
    and those no running server runs (new ones, or a stopped server's), which it takes
    over here (a compare-and-set on ``runner``: of two servers, one takes each)."""
    marks = ",".join("?" * len(ACTIVE_BATCH))
    rows = tx.rows(
        f"SELECT body, runner FROM batches WHERE status IN ({marks}) ORDER BY created_at, id",
        ACTIVE_BATCH,
    )
    running = live(tx, me)
    mine = []
    for body, runner in rows:
        batch = loads(body)
        if runner != me.id:
            if runner in running:
                continue  # another server runs it
            condition, args = runner_is(runner)
            taken = tx.execute(
                f"UPDATE batches SET runner = ? WHERE id = ? AND {condition}",
                (me.id, batch["id"], *args),
            )
            if not taken:
                continue
        mine.append(batch)
    return mine


def files_in_use(tx: Transaction) -> dict[str, str]:
    """File id -> id of the batch not over yet that reads or writes it."""
    used: dict[str, str] = {}
    for batch in active_batches(tx):
        for key in ("input_file_id", "output_file_id", "error_file_id"):
            if batch.get(key):
                used[batch[key]] = batch["id"]
    return used


def start_batch(tx: Transaction, batch_id: str, total: int, at: int | None = None) -> bool:
    """``validating`` -> ``in_progress`` with ``total`` lines; False (nothing changed) when
    the batch is no longer validating (it was cancelled meanwhile)."""
    batch = _load(tx, batch_id)
    if batch["status"] != "validating":
        return False
    batch["request_counts"] = {"total": total, "completed": 0, "failed": 0}
    _set_status(batch, "in_progress", at)
    _save(tx, batch)
    return True


def fail_batch(
    tx: Transaction,
    batch_id: str,
    errors: list[dict[str, Any]],
    at: int | None = None,
    *,
    only_from: tuple[str, ...] = ("validating",),
) -> bool:
    """``validating`` (or any of ``only_from``) -> ``failed``, with ``errors`` (``{code,
    message, param, line}`` each) as the object's ``errors``; False, and nothing changed,
    when the batch has another status."""
    batch = _with_counts(tx, _load(tx, batch_id))
    if batch["status"] not in only_from:
        return False
    batch["errors"] = {"object": "list", "data": errors}
    _set_status(batch, "failed", at)
    _save(tx, batch)
    return True


def batch_status(tx: Transaction, batch_id: str) -> str | None:
    """The status of ``batch_id``; None when it is not stored."""
    row = tx.one("SELECT status FROM batches WHERE id = ?", (batch_id,))
    return None if row is None else str(row[0])


def begin_finalizing(tx: Transaction, batch_id: str, at: int | None = None) -> bool:
    """``in_progress`` -> ``finalizing``; False when the batch is not in progress."""
    batch = _load(tx, batch_id)
    if batch["status"] != "in_progress":
        return False
    _set_status(batch, "finalizing", at)
    _save(tx, batch)
    return True


def record_result(tx: Transaction, batch_id: str, line: int, ok: bool, result: str) -> bool:
    """Record line ``line``'s output-file line (``ok``: it goes to the output file, else
    to the error file); False, and nothing changed, when the line was recorded before."""
    changed = tx.execute(
        "INSERT INTO batch_results (batch_id, line, ok, result) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (batch_id, line) DO NOTHING",
        (batch_id, line, int(ok), result),
    )
    return changed > 0


def recorded_lines(tx: Transaction, batch_id: str) -> set[int]:
    """The lines of ``batch_id`` that have a result."""
    rows = tx.rows("SELECT line FROM batch_results WHERE batch_id = ?", (batch_id,))
    return {int(row[0]) for row in rows}


def results(
    tx: Transaction, batch_id: str, after: int = -1, limit: int = 1000
) -> list[tuple[int, bool, str]]:
    """Recorded ``(line, ok, result)`` of ``batch_id`` past line ``after``, in line order,
    at most ``limit``."""
    rows = tx.rows(
        "SELECT line, ok, result FROM batch_results WHERE batch_id = ? AND line > ? "
        "ORDER BY line LIMIT ?",
        (batch_id, after, limit),
    )
    return [(int(row[0]), bool(row[1]), str(row[2])) for row in rows]


def write_result_files(
    transaction: Callable[[Callable[[Transaction], Any]], Any], files_dir: Path, batch_id: str
) -> dict[str, tuple[str, int] | None]:
    """Write the output and error files of ``batch_id`` from its recorded results, in
    line order, a page of results at a time (blocking: a worker thread).

    Args:
        transaction: runs a unit of work (`trio_llm.store.Store.transaction_sync`).

    Returns:
        ``output`` and ``error`` -> ``(file id, bytes)``, or None where no line went.

    Raises:
        OSError: the disk is full or failing (nothing is left behind).
    """
    writers = {kind: FileWriter(files_dir, output_file_id(batch_id, kind)) for kind in KINDS}
    try:
        after = -1
        while page := transaction(partial(results, batch_id=batch_id, after=after)):
            for _, ok, result in page:
                writers["output" if ok else "error"].write(result.encode() + b"\n")
            after = page[-1][0]
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    written: dict[str, tuple[str, int] | None] = {}
    for kind, writer in writers.items():
        if writer.nbytes:
            written[kind] = (output_file_id(batch_id, kind), writer.finish())
        else:
            writer.discard()
            written[kind] = None
    return written


def finish_batch(
    tx: Transaction,
    batch_id: str,
    status: str,
    files: dict[str, tuple[str, int] | None],
    expires_at: int | None,
    at: int | None = None,
) -> dict[str, Any]:
    """End a batch: register its files, freeze its counts, drop its line results, and set
    ``status`` (``completed``, ``cancelled`` or ``expired``), all at once. A batch already
    over is returned unchanged.

    Args:
        files: ``output`` and ``error`` -> ``(file id, size in bytes)`` of the contents
            written, or None where there was nothing to write.
        expires_at: the files' ``expires_at``.
    """
    batch = _with_counts(tx, _load(tx, batch_id))
    if batch["status"] in FINAL_STATUSES:
        return batch
    created = now() if at is None else at
    for kind, written in files.items():
        if written is None:
            continue
        file_id, nbytes = written
        insert_file(
            tx,
            file_id,
            filename=f"{batch_id}_{kind}.jsonl",
            purpose=BATCH_OUTPUT,
            nbytes=nbytes,
            created_at=created,
            expires_at=expires_at,
        )
        batch[f"{kind}_file_id"] = file_id
    _set_status(batch, status, at)
    _save(tx, batch)
    tx.execute("DELETE FROM batch_results WHERE batch_id = ?", (batch_id,))
    return batch
