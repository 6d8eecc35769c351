"""Faults of the store's database for tests: a SQLite file at its size limit, and one
locked by another process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trio_llm.store import Store, Transaction

#: Takes SQLite's exclusive lock on the file ``argv[1]``, says so, and holds it until its
#: stdin closes.
_LOCK_HOLDER = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
connection.execute("ROLLBACK")
"""


def fill_sqlite_to_the_brim(store: Store) -> None:
    """Cap the store's SQLite file at its present size (``PRAGMA max_page_count`` on its
    one connection): the next write that needs a new page finds the disk full."""

    def cap(tx: Transaction) -> None:
        pages = tx.one("PRAGMA page_count")[0]
        tx.one(f"PRAGMA max_page_count = {pages}")

    store.transaction_sync(cap)


@contextmanager
def sqlite_locked_by_another_process(path: Path) -> Iterator[None]:
    """Another process holds SQLite's exclusive lock on the file ``path`` inside the
    ``with`` block (a second server writing, a backup tool)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "locked\n", "the lock holder failed"
        yield
    finally:
        holder.stdin.close()
        holder.stdout.close()
        assert holder.wait(30) == 0
