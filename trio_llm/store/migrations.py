"""The store's schema, versioned: each migration is applied once, in order, in one
transaction, and the version reached is recorded in ``store_schema``.

A new table or column is a new entry at the end of `MIGRATIONS` (never an edit of an old
one: a database made by an older server must reach the same schema). A server that finds
a database newer than it knows refuses to start rather than misread it. Replicas starting
together on one PostgreSQL database take an advisory lock, so each migration runs once.
"""

from __future__ import annotations

import logging

from trio_llm.store.database import Database, StoreError, Transaction

logger = logging.getLogger(__name__)

#: An arbitrary key of PostgreSQL's advisory lock held while migrating.
_MIGRATION_LOCK = 0x7472696F6C6C6D

#: Migrations by version (1-based): each a list of statements.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: stored responses, conversations, files, batches, evictions.
    (
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            created_at BIGINT NOT NULL,
            status TEXT NOT NULL,
            background INTEGER NOT NULL,
            model TEXT NOT NULL,
            previous_response_id TEXT,
            conversation_id TEXT,
            request TEXT NOT NULL,
            context TEXT NOT NULL,
            body TEXT NOT NULL,
            nbytes BIGINT NOT NULL
        )""",
        "CREATE INDEX responses_created ON responses (created_at)",
        "CREATE INDEX responses_status ON responses (status)",
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            created_at BIGINT NOT NULL,
            metadata TEXT NOT NULL,
            next_seq BIGINT NOT NULL,
            nbytes BIGINT NOT NULL
        )""",
        "CREATE INDEX conversations_created ON conversations (created_at)",
        """CREATE TABLE conversation_items (
            conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            seq BIGINT NOT NULL,
            item_id TEXT NOT NULL UNIQUE,
            item TEXT NOT NULL,
            PRIMARY KEY (conversation_id, seq)
        )""",
        """CREATE TABLE files (
            id TEXT PRIMARY KEY,
            created_at BIGINT NOT NULL,
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            status TEXT NOT NULL,
            expires_at BIGINT
        )""",
        "CREATE INDEX files_created ON files (created_at)",
        """CREATE TABLE batches (
            id TEXT PRIMARY KEY,
            created_at BIGINT NOT NULL,
            status TEXT NOT NULL,
            body TEXT NOT NULL
        )""",
        "CREATE INDEX batches_created ON batches (created_at)",
        "CREATE INDEX batches_status ON batches (status)",
        """CREATE TABLE batch_results (
            batch_id TEXT NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
            line BIGINT NOT NULL,
            ok INTEGER NOT NULL,
            result TEXT NOT NULL,
            PRIMARY KEY (batch_id, line)
        )""",
        """CREATE TABLE evicted (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            evicted_at BIGINT NOT NULL,
            reason TEXT NOT NULL
        )""",
        "CREATE INDEX evicted_at ON evicted (evicted_at)",
    ),
    # 2: the server running each background response and batch (`runners`).
    (
        """CREATE TABLE store_runners (
            id TEXT PRIMARY KEY,
            machine TEXT NOT NULL,
            pid BIGINT NOT NULL,
            seen_at BIGINT NOT NULL
        )""",
        "ALTER TABLE responses ADD COLUMN runner TEXT",
        "ALTER TABLE batches ADD COLUMN runner TEXT",
    ),
    # 3: a response's context refers to a conversation's items (the conversation and its
    # items before context_seq) instead of copying them; items and conversations deleted
    # while a stored response lists them are hidden until it goes
    # (`trio_llm.store.conversations`). Older rows keep their whole context, and read so.
    (
        "ALTER TABLE responses ADD COLUMN context_conversation TEXT",
        "ALTER TABLE responses ADD COLUMN context_seq BIGINT",
        "CREATE INDEX responses_context ON responses (context_conversation, context_seq)",
        "ALTER TABLE conversations ADD COLUMN hidden INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE conversation_items ADD COLUMN hidden_at BIGINT",
        "CREATE INDEX conversation_items_hidden ON conversation_items (hidden_at)",
        "CREATE INDEX conversations_hidden ON conversations (hidden)",
    ),
)

#: The schema version this server writes.
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(tx: Transaction) -> int:
    """The version recorded in the database (0 for a new one)."""
    tx.execute("CREATE TABLE IF NOT EXISTS store_schema (version BIGINT NOT NULL)")
    row = tx.one("SELECT MAX(version) FROM store_schema")
    return int(row[0]) if row is not None and row[0] is not None else 0


def _migrate(tx: Transaction) -> tuple[int, int]:
    if tx.dialect == "postgresql":
        tx.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
    found = schema_version(tx)
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"the store's schema is version {found}, newer than this server's "
            f"({SCHEMA_VERSION}): upgrade trio_llm or use another --store-url"
        )
    for version in range(found + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[version - 1]:
            tx.execute(statement)
        tx.execute("INSERT INTO store_schema (version) VALUES (?)", (version,))
    return found, SCHEMA_VERSION


def migrate(database: Database) -> tuple[int, int]:
    """Bring ``database`` to `SCHEMA_VERSION` (blocking: call at start-up, in a thread).

    Returns:
        The versions before and after.

    Raises:
        StoreError: the database is newer than this server, or a migration failed
            (nothing of it is applied).
    """
    before, after = database.transaction_sync(_migrate)
    if before != after:
        logger.info(f"store {database.url}: schema version {before} -> {after}")
    return before, after
