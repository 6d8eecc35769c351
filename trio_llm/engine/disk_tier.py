"""The prefix cache's tier on disk: one file per full KV block, in a folder per namespace
(`trio_llm.engine.kv_files`), shared by every engine, restart and server that computes
the same blocks.

Only the engine loop and this module's writer thread touch the files (`EngineCore.step`
does no I/O):
- **Reads** (`DiskTier.read`) open a block file without following links, take only a
  regular file no larger than a block's file can be, and check it whole
  (`kv_files.decode`); a file that is not the block is counted in ``refused``, removed,
  and its block computed again.
- **Writes** (`DiskTier.offer`) go through a bounded queue to one writer thread: a full
  queue drops the block (counted), never delays a step. Each file is written under a
  temporary name and renamed into place, so no reader sees half a block, whoever wrote it.
  A full or read-only disk is one log line; the tier then stops writing and the cache keeps
  working in memory.
- **The bound** (``--prefix-cache-disk-bytes``): past it, the files least recently used
  (a read refreshes a file's time) are removed until the folder holds 90 % of it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trio_llm.config import PREFIX_CACHE_QUEUE_BYTES
from trio_llm.engine import kv_files

logger = logging.getLogger(__name__)

#: Bytes of block copies waiting for the writer at most (more are dropped).
WRITE_QUEUE_BYTES = PREFIX_CACHE_QUEUE_BYTES


@dataclass
class TierCounters:
    """Running totals of one engine's disk tier (``/metrics``' ``prefix_cache_disk_*``).

    Attributes:
        hits, misses: blocks looked for on disk and found / not found.
        bytes_read, bytes_written: file bytes read back and written.
        evicted: files removed to keep the bound.
        refused: files that were not the block they should be (removed).
        dropped: blocks not written: the queue was full, or writing is off.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evicted: int = 0
    refused: int = 0
    dropped: int = 0


@dataclass
class _Index:
    """The files of the folder this engine knows, with their size and last use."""

    files: dict[str, tuple[int, float]] = field(default_factory=dict)
    total: int = 0

    def add(self, name: str, size: int, used: float) -> None:
        self.remove(name)
        self.files[name] = (size, used)
        self.total += size

    def remove(self, name: str) -> None:
        old = self.files.pop(name, None)
        if old is not None:
            self.total -= old[0]


class DiskTier:
    """The block files of one namespace (see the module doc).

    Args:
        root: the tier's folder (``--prefix-cache-dir``); the namespace's folder is made
            in it.
        space: the namespace (`kv_files.namespace`): model, dtypes, layout, block size.
        max_bytes: the bound on the files of this namespace.
        dtype: the KV cache's dtype.
        shapes: each tensor of a block in order (`kv_files.encode`).
    """

    def __init__(
        self,
        root: Path,
        space: str,
        max_bytes: int,
        dtype: torch.dtype,
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        self.folder = Path(root) / space
        self.folder.mkdir(parents=True, exist_ok=True)
        self.space = space
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.shapes = [tuple(shape) for shape in shapes]
        itemsize = torch.empty((), dtype=dtype).element_size()
        payload = sum(int(torch.Size(shape).numel()) for shape in self.shapes) * itemsize
        #: The largest file a block can be: longer ones are refused unread.
        self.max_file_bytes = payload + kv_files.MAX_HEADER_BYTES + 64
        self.counters = TierCounters()
        self.writing = True
        self._lock = threading.Lock()
        self._index = _Index()
        self._scan()
        self._queue: queue.Queue[tuple[int, bytes, list[torch.Tensor]] | None] = queue.Queue(
            max(1, WRITE_QUEUE_BYTES // payload)
        )
        self._writer = threading.Thread(target=self._write_all, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def name(self, group: int, key: bytes) -> str:
        """The file name of prefix block ``key`` of ``group``."""
        return f"{key.hex()}.g{group}.kv"

    # ------------------------------------------------------------ reading

    def read(self, group: int, key: bytes) -> list[torch.Tensor] | None:
        """The tensors of block ``key`` of ``group`` from its file, or None: no file, or
        one that is not that block (refused: counted and removed)."""
        name = self.name(group, key)
        path = self.folder / name
        try:
            data = self._read_file(path)
        except FileNotFoundError:
            with self._lock:
                self.counters.misses += 1
            return None
        except (OSError, kv_files.BlockFileError) as exc:
            return self._refuse(name, str(exc))
        try:
            tensors = kv_files.decode(data, self.space, group, key, self.dtype, self.shapes)
        except kv_files.BlockFileError as exc:
            return self._refuse(name, str(exc))
        try:
            os.utime(path)  # used now: the last to be evicted
        except OSError:
            pass
        with self._lock:
            self.counters.hits += 1
            self.counters.bytes_read += len(data)
            self._index.add(name, len(data), _now(path))
        return tensors

    def _read_file(self, path: Path) -> bytes:
        """The bytes of ``path``: a regular file (no link followed) of at most
        `max_file_bytes`.

        Raises:
            FileNotFoundError: there is none.
            OSError: it cannot be opened (a link, a folder).
            BlockFileError: not a regular file, or too long.
        """
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise kv_files.BlockFileError("not a regular file")
            if info.st_size > self.max_file_bytes:
                raise kv_files.BlockFileError(f"{info.st_size} bytes, more than a block's file")
            return file.read(self.max_file_bytes + 1)

    def _refuse(self, name: str, why: str) -> None:
        logger.warning("prefix cache on disk: refused %s (%s); it is computed again", name, why)
        with self._lock:
            self.counters.refused += 1
            self._index.remove(name)
        try:
            os.unlink(self.folder / name)
        except OSError:
            pass
        return None

    # ------------------------------------------------------------ writing

    def offer(self, group: int, key: bytes, tensors: list[torch.Tensor]) -> bool:
        """Queue block ``key`` of ``group`` (``tensors``: the caller's own copies) for the
        writer; False when it is dropped (the queue is full, or writing is off)."""
        if self.writing:
            try:
                self._queue.put_nowait((group, key, tensors))
                return True
            except queue.Full:
                pass
        with self._lock:
            self.counters.dropped += 1
        return False

    def flush(self) -> None:
        """Wait until every queued block is written (tests, and `close`)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        self._queue.put(None)
        self._writer.join()

    def _write_all(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.writing:
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, group: int, key: bytes, tensors: list[torch.Tensor]) -> None:
        name = self.name(group, key)
        path = self.folder / name
        if path.exists():  # another engine or server wrote it
            return
        data = kv_files.encode(self.space, group, key, tensors)
        temporary = self.folder / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "xb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as exc:
            _unlink_quietly(temporary)
            if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
                self.writing = False
                logger.warning(
                    "prefix cache on disk: writing stopped (%s); the cache keeps working in memory",
                    exc,
                )
            return
        with self._lock:
            self.counters.bytes_written += len(data)
            self._index.add(name, len(data), _now(path))
            over = self._index.total > self.max_bytes
        if over:
            self._evict()

    # ------------------------------------------------------------ the bound

    def _scan(self) -> None:
        """Index the folder's block files (another engine's and earlier runs' too), and
        remove the temporary files of writers that are gone (killed mid-write)."""
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".kv") and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                self._index.add(entry.name, info.st_size, info.st_mtime)
            elif entry.name.endswith(".tmp") and not _writer_alive(entry.name):
                _unlink_quietly(Path(entry.path))

    def _evict(self) -> None:
        """Remove the least recently used files until the folder holds 90 % of the bound
        (rescanned first: other engines write here too)."""
        with self._lock:
            self._index = _Index()
            self._scan()
            order = sorted(self._index.files.items(), key=lambda item: item[1][1])
            target = self.max_bytes * 9 // 10
            for name, _ in order:
                if self._index.total <= target:
                    break
                _unlink_quietly(self.folder / name)
                self._index.remove(name)
                self.counters.evicted += 1


def _writer_alive(name: str) -> bool:
    """Whether the process that writes temporary file ``name`` (``.{file}.{pid}.{id}.tmp``)
    still runs on this machine (a name of another shape counts as alive: left alone)."""
    parts = name.split(".")
    if len(parts) < 4 or not parts[-3].isdigit():
        return True
    try:
        os.kill(int(parts[-3]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _now(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
