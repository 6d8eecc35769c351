"""State that survives the server: stored responses, conversations, files and batches.

`open_store` connects to the ``--store-url`` database (`database`), brings its schema up to
date (`migrations`) and returns a `Store`: the database, the retention policy
(`retention`) and the folder where file contents live. Each kind of object has its own
module of units of work on it (`responses`, `conversations`, `files`, `batches`), each a
function of a `Transaction` that `Store.transaction` runs in a worker thread; the API
(`trio_llm.api`) and the batch runner use those, never SQL. Nothing here imports the
API or the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import trio

from trio_llm.store import runners
from trio_llm.store.conversations import ConversationFull, ConversationLimits
from trio_llm.store.database import (
    Database,
    StoreError,
    StoreUnavailable,
    Transaction,
    make_folder,
    open_database,
)
from trio_llm.store.migrations import migrate
from trio_llm.store.objects import Evicted, NotFound
from trio_llm.store.retention import RetentionPolicy, sweep
from trio_llm.store.runners import Runner, this_runner

__all__ = [
    "ConversationFull",
    "ConversationLimits",
    "Evicted",
    "NotFound",
    "RetentionPolicy",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "Transaction",
    "open_store",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two retention sweeps of a running server.
SWEEP_INTERVAL = 60.0


@dataclass
class Store:
    """The open store of a server (or of ``trio-llm run-batch``).

    Attributes:
        database: the database connection(s).
        policy: what is kept, and for how long.
        files_dir: where the contents of uploaded and generated files are kept, one file
            per id (`trio_llm.store.files`).
        runner: this server, as the runner of its background responses and batches
            (`trio_llm.store.runners`; registered by `open_store`).
        conversation_limits: how large a conversation may grow (the API passes them to
            `conversations.add_items`).
        closed: set by `close`.
    """

    database: Database
    policy: RetentionPolicy
    files_dir: Path
    runner: Runner = field(default_factory=this_runner)
    conversation_limits: ConversationLimits = field(default_factory=ConversationLimits)
    closed: bool = field(default=False, init=False)

    async def transaction(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in one transaction in a worker thread (`Database.transaction`)."""
        return await self.database.transaction(work)

    def transaction_sync(self, work: Callable[[Transaction], T]) -> T:
        """`transaction` from a worker thread."""
        return self.database.transaction_sync(work)

    async def sweep(self) -> list[tuple[str, str]]:
        """Evict what the retention policy no longer keeps (`retention.sweep`) and delete
        the contents of evicted files; return ``(kind, id)`` of each evicted object."""
        removed = await self.transaction(lambda tx: sweep(tx, self.policy))
        for kind, object_id in removed:
            if kind == "file":
                (self.files_dir / object_id).unlink(missing_ok=True)
        if removed:
            logger.info(f"store: evicted {len(removed)} objects (retention)")
        return removed

    async def run_retention(self, interval: float = SWEEP_INTERVAL) -> None:
        """Sweep now and every ``interval`` seconds, until cancelled; a sweep that fails
        (the database busy or unreachable) is logged and tried again next time."""
        while True:
            try:
                await self.sweep()
            except StoreError as exc:
                logger.warning(f"store: retention sweep failed: {exc}")
            await trio.sleep(interval)

    async def run_heartbeat(self, interval: float = runners.HEARTBEAT_SECONDS) -> None:
        """Write this runner's heartbeat now and every ``interval`` seconds, until
        cancelled (a failed one is logged and tried again next time)."""
        while True:
            try:
                await self.transaction(partial(runners.beat, runner=self.runner))
            except StoreError as exc:
                logger.warning(f"store: heartbeat failed: {exc}")
            await trio.sleep(interval)

    def close(self) -> None:
        """Forget this runner (another server may take over its work at once), then close
        the database connections (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.transaction_sync(partial(runners.forget, runner=self.runner))
        except StoreError as exc:
            logger.warning(f"store: could not remove this server's runner: {exc}")
        self.database.close()


def open_store(
    url: str,
    cache_dir: Path,
    policy: RetentionPolicy | None = None,
    conversation_limits: ConversationLimits | None = None,
) -> Store:
    """Open the store a ``--store-url`` names and migrate its schema (blocking: run it in a
    worker thread from async code).

    Args:
        url: see `open_database`.
        cache_dir: the server's cache folder (files of a PostgreSQL store go under it).
        policy: retention; None: `RetentionPolicy`'s defaults.
        conversation_limits: `Store.conversation_limits`; None: no limit.

    Raises:
        ValueError: a malformed URL, or psycopg missing for PostgreSQL.
        StoreError: the database cannot be opened or migrated, or a folder of the store
            cannot be made (a file in the way: one line that names it).
    """
    database = open_database(url, cache_dir)
    try:
        migrate(database)
    except BaseException:
        database.close()
        raise
    files_dir = database.folder / "files"
    try:
        make_folder(files_dir, "the folder of the store's files")
    except BaseException:
        database.close()
        raise
    limits = conversation_limits or ConversationLimits()
    store = Store(database, policy or RetentionPolicy(), files_dir, conversation_limits=limits)
    try:
        database.transaction_sync(partial(runners.register, runner=store.runner))
    except BaseException:
        database.close()
        raise
    return store
