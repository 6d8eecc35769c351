"""The server's database: SQLite (the standard library's, by default) or PostgreSQL, reached
only from worker threads, one transaction per unit of work.

`open_database` takes a ``--store-url``: ``sqlite:///PATH`` (a file, relative to the working
directory, ``sqlite:////PATH`` for an absolute one: SQLAlchemy's spelling; created with its
folder) or ``postgresql://user@host:port/db`` (psycopg 3, the ``postgres`` extra; for
replicas behind a router that must share the store). Every unit of work is a function of
a `Transaction` run by `Database.transaction` in a worker thread between ``BEGIN`` and
``COMMIT`` (``ROLLBACK`` when it raises), so the event loop never waits on the disk or the
network and a failed write leaves nothing half done. SQL is written once with ``?``
placeholders and the subset both dialects share (``ON CONFLICT ... DO NOTHING``,
``BIGINT``, ``TEXT``).

The database's own failures become `StoreError`s that say what the client can do: a
database locked by another writer beyond the busy timeout, a lost connection or a full
disk is `StoreUnavailable` (the API answers 503, 507 for the full disk), never a crash of
the server. On PostgreSQL every transaction waits at most `POSTGRES_LOCK_TIMEOUT` for a
lock (``lock_timeout``) and runs each statement for at most `POSTGRES_STATEMENT_TIMEOUT`
(``statement_timeout``), so a row or table held by another connection, or a server that
stopped answering, is a `StoreUnavailable` in bounded time, not a request that hangs; a
connection that failed is closed, not reused.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

import trio

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a SQLite writer waits for another process's write lock before giving up.
SQLITE_BUSY_TIMEOUT = 5.0

#: Seconds a PostgreSQL statement waits for a lock another connection holds
#: (``lock_timeout``), and the longest it may run (``statement_timeout``).
POSTGRES_LOCK_TIMEOUT = 5.0
POSTGRES_STATEMENT_TIMEOUT = 30.0

#: Seconds to wait for a PostgreSQL server to accept a connection.
POSTGRES_CONNECT_TIMEOUT = 10

Dialect = Literal["sqlite", "postgresql"]


class StoreError(Exception):
    """A stored object could not be read or written; the message says why."""


class StoreUnavailable(StoreError):
    """The database cannot be used now (locked by another writer, the connection lost,
    the disk full): the request may be retried later. ``full`` tells a full disk."""

    def __init__(self, message: str, *, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


class Row(Protocol):
    """A result row: its values by position (both drivers' rows are sequences)."""

    def __getitem__(self, index: int) -> Any: ...


class Transaction:
    """One transaction's statements, run in the worker thread that holds the connection.

    Args:
        cursor: the DB-API cursor of the connection.
        dialect: which database the SQL runs on (for PostgreSQL ``?`` becomes ``%s``, and
            a literal ``%`` is escaped for psycopg's placeholder syntax).
    """

    def __init__(self, cursor: Any, dialect: Dialect) -> None:
        self._cursor = cursor
        self.dialect = dialect

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return max(self._cursor.rowcount, 0)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run a query; return every row."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return list(self._cursor.fetchall())

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """Run a query; return its first row, or None."""
        self._cursor.execute(self._sql(sql), tuple(params))
        return self._cursor.fetchone()

    def _sql(self, sql: str) -> str:
        if self.dialect == "postgresql":
            return sql.replace("%", "%%").replace("?", "%s")
        return sql


class Database:
    """A connection (SQLite) or a few (PostgreSQL), used from worker threads only.

    Use `open_database`. ``transaction`` serialises SQLite's work on its one connection
    (SQLite has one writer at a time anyway); PostgreSQL's runs on up to ``pool_size``
    connections at once.

    Attributes:
        url: the ``--store-url`` (with any password left out).
        dialect: ``sqlite`` or ``postgresql``.
        folder: where files stored beside the database go (`trio_llm.store.files`):
            the SQLite file's folder, or the server's cache folder for PostgreSQL.
    """

    def __init__(
        self,
        url: str,
        dialect: Dialect,
        connect: Callable[[], Any],
        folder: Path,
        pool_size: int = 1,
    ) -> None:
        self.url = url
        self.dialect = dialect
        self.folder = folder
        self._connect = connect
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(pool_size)
        self._closed = False

    async def transaction(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in one transaction in a worker thread; return what it returns.

        Cancellation waits for the transaction to end (a connection is never left in the
        middle of one), so keep units of work short.

        Raises:
            StoreUnavailable: the database is locked, unreachable or its disk is full.
            StoreError: another database error (the message names it).
            Exception: whatever ``work`` raises (after a rollback).
        """
        async with self._limiter:
            return await trio.to_thread.run_sync(self.transaction_sync, work)

    def transaction_sync(self, work: Callable[[Transaction], T]) -> T:
        """`transaction` for code already in a worker thread (or with no event loop)."""
        with self._connection() as connection:
            cursor = connection.cursor()
            try:
                cursor.execute(_begin(self.dialect))
                result = work(Transaction(cursor, self.dialect))
                cursor.execute("COMMIT")
                return result
            except BaseException:
                _rollback(cursor)
                raise
            finally:
                cursor.close()

    def close(self) -> None:
        """Close every connection (idempotent); later transactions raise `StoreError`."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            connection = self._idle.pop() if self._idle else None
        try:
            with _database_errors(self.dialect):
                if connection is None:
                    connection = self._connect()
                yield connection
        finally:
            if connection is not None:
                with self._lock:
                    keep = not self._closed and _reusable(connection, self.dialect)
                    if keep:
                        self._idle.append(connection)
                if not keep:
                    connection.close()


def _begin(dialect: Dialect) -> str:
    """The statement that opens a transaction: SQLite's takes the write lock at once (no
    deadlock between two readers that both write later); PostgreSQL's sets the
    transaction's lock and statement timeouts (in one round trip)."""
    if dialect == "sqlite":
        return "BEGIN IMMEDIATE"
    lock_ms = round(POSTGRES_LOCK_TIMEOUT * 1000)
    statement_ms = round(POSTGRES_STATEMENT_TIMEOUT * 1000)
    return (
        f"BEGIN; SET LOCAL lock_timeout = {lock_ms}; SET LOCAL statement_timeout = {statement_ms}"
    )


def _reusable(connection: Any, dialect: Dialect) -> bool:
    """Whether a connection may serve the next transaction: a PostgreSQL connection that
    is closed, broken or still inside a transaction (its rollback failed) is not."""
    if dialect == "sqlite":
        return True
    from psycopg.pq import TransactionStatus

    return (
        not connection.closed
        and not connection.broken
        and connection.info.transaction_status == TransactionStatus.IDLE
    )


def _rollback(cursor: Any) -> None:
    try:
        cursor.execute("ROLLBACK")
    except Exception:  # the connection is gone: nothing to roll back
        logger.debug("rollback failed", exc_info=True)


@contextmanager
def _database_errors(dialect: Dialect) -> Iterator[None]:
    """Turn the drivers' errors into `StoreError` / `StoreUnavailable`."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if "locked" in text or "busy" in text:
            raise StoreUnavailable(f"the store is busy: {text}") from exc
        if "full" in text or "disk I/O" in text or "unable to open" in text:
            raise StoreUnavailable(f"the store cannot write: {text}", full="full" in text) from exc
        raise StoreError(f"store error: {text}") from exc
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"store error: {exc}") from exc
    except Exception as exc:
        if dialect == "postgresql" and _is_postgres_error(exc):
            raise _postgres_error(exc) from exc
        raise


def _is_postgres_error(exc: Exception) -> bool:
    return type(exc).__module__.startswith("psycopg")


def _postgres_error(exc: Exception) -> StoreError:
    """A psycopg error as a `StoreError`: a full disk, a lock or statement timeout, a
    deadlock, a lost or refused connection (PostgreSQL's "operational" errors) are
    `StoreUnavailable`; anything else (a bad statement, a broken constraint) is not."""
    from psycopg import OperationalError, errors

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, errors.DiskFull):
        return StoreUnavailable(f"the store cannot write: {text}", full=True)
    busy = (errors.LockNotAvailable, errors.QueryCanceled, errors.TransactionRollback)
    if isinstance(exc, busy):
        return StoreUnavailable(f"the store is busy: {text}")
    if isinstance(exc, OperationalError):
        return StoreUnavailable(f"the store is unavailable: {text}")
    return StoreError(f"store error: {text}")


def open_database(url: str, cache_dir: Path) -> Database:
    """Connect to the database a ``--store-url`` names (no schema work: see
    `trio_llm.store.migrations.migrate`).

    Args:
        url: ``sqlite:///PATH`` (`sqlite_target`: relative to the working directory;
            ``sqlite:////ABSOLUTE/PATH``), ``sqlite:///:memory:`` (tests), or a
            ``postgresql://`` URL (libpq's form).
        cache_dir: where files go when the database is PostgreSQL (``cache_dir/store``).

    Raises:
        ValueError: the URL's scheme is neither; psycopg is not installed for a
            ``postgresql://`` URL.
        StoreUnavailable: the database cannot be opened or reached.
        StoreError: the SQLite file's folder cannot be made (`make_folder`).
    """
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        return _open_sqlite(url)
    if scheme in ("postgresql", "postgres"):
        return _open_postgres(url, cache_dir)
    raise ValueError(f"--store-url must be sqlite:///PATH or postgresql://..., got {redact(url)!r}")


def redact(url: str) -> str:
    """``url`` without its password (for logs and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


def sqlite_target(url: str) -> str:
    """The file a ``sqlite:`` ``--store-url`` names, as an absolute path (or
    ``:memory:``), in SQLAlchemy's spelling: ``sqlite:///relative/store.db`` is relative to
    the working directory, ``sqlite:////abs/store.db`` absolute.

    Raises:
        ValueError: the URL names a host (``sqlite://host/...``) or no file.
    """
    rest = url.removeprefix("sqlite://")
    path = rest[1:] if rest.startswith("/") else None
    if rest == ":memory:" or path == ":memory:":
        return ":memory:"
    if path is None or path in ("", ".") or path.endswith("/"):
        raise ValueError(
            f"--store-url {url!r}: a SQLite store is sqlite:///PATH (relative to the working "
            "directory) or sqlite:////ABSOLUTE/PATH, naming a file"
        )
    target = Path.cwd() / path  # an absolute path stays as it is
    if not target.exists() and not Path(path).is_absolute() and Path("/", path).exists():
        # Before SQLAlchemy's convention, sqlite:///PATH was absolute: never start afresh
        # beside a store an older server kept at /PATH.
        raise ValueError(
            f"--store-url {url!r} names {target} (sqlite:///PATH is relative to the working "
            f"directory), which does not exist, but /{path} does: for that one, write "
            f"sqlite:////{path}"
        )
    return str(target)


def make_folder(folder: Path, what: str) -> None:
    """Make ``folder`` (and its parents) unless it exists.

    Raises:
        StoreError: it cannot be made (a file stands in its way, no permission): the
            message names ``what`` and the path, in one line.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (folder, *folder.parents) if p.is_file()), None)
        why = f"{blocker} is a file, not a folder" if blocker else exc.strerror or str(exc)
        raise StoreError(f"cannot make {what} {folder}: {why}") from None


def _open_sqlite(url: str) -> Database:
    target = sqlite_target(url)
    if target == ":memory:":
        folder = Path.cwd()
    else:
        folder = Path(target).parent
        make_folder(folder, "the store's folder")

    def connect() -> sqlite3.Connection:
        connection = sqlite3.connect(
            target, timeout=SQLITE_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
        )
        connection.execute("PRAGMA foreign_keys = ON")
        if target != ":memory:":
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = NORMAL")
        return connection

    with _database_errors("sqlite"):
        connect().close()  # fail at start-up, not at the first request
    database = Database(url, "sqlite", connect, folder)
    if target == ":memory:":
        # One connection for the life of the database: another would see an empty one.
        with _database_errors("sqlite"):
            database._idle.append(connect())
    return database


def _open_postgres(url: str, cache_dir: Path) -> Database:
    try:
        import psycopg
    except ImportError:
        raise ValueError(
            "--store-url postgresql://... needs psycopg 3: pip install 'trio_llm[postgres]'"
        ) from None

    def connect() -> Any:
        return psycopg.connect(url, connect_timeout=POSTGRES_CONNECT_TIMEOUT, autocommit=True)

    with _database_errors("postgresql"):
        connect().close()
    folder = cache_dir / "store"
    return Database(redact(url), "postgresql", connect, folder, pool_size=4)
