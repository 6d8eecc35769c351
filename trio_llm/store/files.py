"""Files (``/v1/files``): their rows, and their contents on disk, one file per id.

A file's contents live in `trio_llm.store.Store.files_dir` under its id; its row (OpenAI's
File object: name, purpose, size, times) lives in table ``files``. Contents are written
by a `FileWriter` (blocking: run it in a worker thread): chunk by chunk into a temporary
name in the same folder, flushed to disk, then renamed to the id, so a reader never sees
half a file and a crash leaves only a temporary file (removed by `remove_orphans`). The
row is inserted after the rename (`insert_file`), in its own transaction; the bytes count
towards the store's size (`trio_llm.store.retention`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from trio_llm.store.database import StoreError, Transaction
from trio_llm.store.objects import Page, missing, new_ordered_id, row_of

logger = logging.getLogger(__name__)

#: Purposes a client may upload a file for (OpenAI's names): batch input, or any file.
UPLOAD_PURPOSES = ("batch", "user_data")
#: The purpose of the output and error files a batch writes.
BATCH_OUTPUT = "batch_output"
#: Every purpose a stored file can have.
PURPOSES = (*UPLOAD_PURPOSES, BATCH_OUTPUT)

#: Suffix of a file's contents while they are written (never a valid id).
PARTIAL_SUFFIX = ".partial"

#: Seconds a file's contents must be untouched before `remove_orphans` may remove them.
ORPHAN_AGE = 3600.0

_COLUMNS = "id, created_at, filename, purpose, bytes, status, expires_at"


class FileTooLarge(StoreError):
    """A file grew past the largest size allowed (``limit`` bytes)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than this server's limit of {limit} bytes")
        self.limit = limit


class FileInUse(StoreError):
    """The file is the input, output or error file of a batch still running."""

    def __init__(self, file_id: str, batch_id: str) -> None:
        super().__init__(
            f"the file '{file_id}' is used by the batch '{batch_id}', which is still "
            "running; cancel the batch or wait for it to end"
        )
        self.file_id = file_id
        self.batch_id = batch_id


def new_file_id() -> str:
    """A new file id (``file-`` and 32 hex digits, in creation order)."""
    return new_ordered_id("file-")


def content_path(files_dir: Path, file_id: str) -> Path:
    """Where the contents of ``file_id`` are kept.

    Raises:
        ValueError: ``file_id`` could name a path outside ``files_dir``.
    """
    if not file_id or "/" in file_id or "\\" in file_id or file_id.startswith("."):
        raise ValueError(f"not a file id: {file_id!r}")
    return files_dir / file_id


class FileWriter:
    """Writes one file's contents to ``files_dir`` without holding them in memory.

    Blocking (run each call in a worker thread). Use `write` for each chunk, then
    `finish` (flush to disk, rename to the id), or `discard` (on any failure).

    Args:
        files_dir: the store's folder of file contents (made again if it is gone).
        file_id: the id the contents will have.
        max_bytes: the largest size allowed; None: no limit.

    Raises:
        OSError: the temporary file cannot be made (no permission, a full disk).
    """

    def __init__(self, files_dir: Path, file_id: str, max_bytes: int | None = None) -> None:
        self.path = content_path(files_dir, file_id)
        self.partial = files_dir / f".{file_id}{PARTIAL_SUFFIX}"
        self.max_bytes = max_bytes
        self.nbytes = 0
        try:
            self._handle = self.partial.open("wb")
        except FileNotFoundError:
            # The folder went away under the running server (removed by hand, a cleaner
            # of temporary files): make it again rather than refuse every file from now on.
            files_dir.mkdir(parents=True, exist_ok=True)
            self._handle = self.partial.open("wb")

    def write(self, data: bytes) -> None:
        """Append ``data``.

        Raises:
            FileTooLarge: the contents would pass ``max_bytes`` (nothing of ``data`` is
                written; call `discard`).
            OSError: the disk is full or failing.
        """
        if self.max_bytes is not None and self.nbytes + len(data) > self.max_bytes:
            raise FileTooLarge(self.max_bytes)
        self._handle.write(data)
        self.nbytes += len(data)

    def finish(self) -> int:
        """Flush the contents to disk and give them their id; return their size in bytes.

        Raises:
            OSError: the disk is full or failing (the partial file is removed).
        """
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(self.partial, self.path)
        except BaseException:
            self.discard()
            raise
        return self.nbytes

    def discard(self) -> None:
        """Drop what was written (idempotent)."""
        self._handle.close()
        self.partial.unlink(missing_ok=True)


def write_file(files_dir: Path, file_id: str, chunks: Any) -> int:
    """Write ``chunks`` (an iterable of bytes) as the contents of ``file_id`` with a
    `FileWriter`; return the size (blocking).

    Raises:
        OSError: the disk is full or failing (nothing is left behind).
    """
    writer = FileWriter(files_dir, file_id)
    try:
        for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.discard()
        raise
    return writer.finish()


def file_object(row: Any) -> dict[str, Any]:
    """OpenAI's File object of a ``files`` row (`_COLUMNS` order)."""
    return {
        "id": row[0],
        "object": "file",
        "bytes": int(row[4]),
        "created_at": int(row[1]),
        "expires_at": None if row[6] is None else int(row[6]),
        "filename": row[2],
        "purpose": row[3],
        "status": row[5],
    }


def insert_file(
    tx: Transaction,
    file_id: str,
    *,
    filename: str,
    purpose: str,
    nbytes: int,
    created_at: int,
    expires_at: int | None,
) -> dict[str, Any]:
    """Record a file whose contents are written; return its File object. An id already
    recorded is left as it is (a batch's output file written again after a restart).

    Raises:
        ValueError: ``purpose`` is not one of `PURPOSES`.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"unknown file purpose {purpose!r}")
    tx.execute(
        f"INSERT INTO files ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        (file_id, created_at, filename, purpose, nbytes, "processed", expires_at),
    )
    return get_file(tx, file_id)


def get_file(tx: Transaction, file_id: str) -> dict[str, Any]:
    """The File object of ``file_id``.

    Raises:
        NotFound: no such file (`Evicted` when the retention removed it).
    """
    return file_object(row_of(tx, "file", f"SELECT {_COLUMNS} FROM files WHERE id = ?", file_id))


def list_files(
    tx: Transaction, *, purpose: str | None, limit: int, order: str, after: str | None
) -> Page:
    """A page of File objects by creation time (``order`` ``asc`` or ``desc``), only those
    of ``purpose`` when given, following the file ``after``.

    Raises:
        NotFound: ``after`` is not a stored file.
    """
    where, params = [], []
    if purpose is not None:
        where.append("purpose = ?")
        params.append(purpose)
    if after is not None:
        row = tx.one("SELECT created_at FROM files WHERE id = ?", (after,))
        if row is None:
            raise missing(tx, "file", after)
        sign = ">" if order == "asc" else "<"
        where.append(f"(created_at {sign} ? OR (created_at = ? AND id {sign} ?))")
        params += [row[0], row[0], after]
    direction = "ASC" if order == "asc" else "DESC"
    clause = f"WHERE {' AND '.join(where)} " if where else ""
    rows = tx.rows(
        f"SELECT {_COLUMNS} FROM files {clause}"
        f"ORDER BY created_at {direction}, id {direction} LIMIT ?",
        (*params, limit + 1),
    )
    return Page([file_object(row) for row in rows[:limit]], len(rows) > limit)


def delete_file(tx: Transaction, file_id: str, active_users: dict[str, str]) -> None:
    """Remove the row of ``file_id`` (the caller deletes its contents after the commit).

    Args:
        active_users: file id -> id of the running batch that uses it
            (`trio_llm.store.batches.files_in_use`).

    Raises:
        NotFound: no such file.
        FileInUse: a running batch reads or writes it.
    """
    get_file(tx, file_id)
    if file_id in active_users:
        raise FileInUse(file_id, active_users[file_id])
    tx.execute("DELETE FROM files WHERE id = ?", (file_id,))


def remove_orphans(tx: Transaction, files_dir: Path, min_age: float = ORPHAN_AGE) -> int:
    """Delete contents left without a row (a crash between writing and recording) and
    partial files, untouched for ``min_age`` seconds (so that another server's upload
    into the same folder is left alone); return how many."""
    known = {row[0] for row in tx.rows("SELECT id FROM files")}
    removed = 0
    oldest = time.time() - min_age
    for path in files_dir.iterdir():
        if path.is_file() and path.name not in known and path.stat().st_mtime < oldest:
            path.unlink(missing_ok=True)
            removed += 1
    if removed:
        logger.info(f"store: removed {removed} file contents left by an earlier server")
    return removed
