"""The store on PostgreSQL, where it fails differently from SQLite: a table or row held by
another connection, a statement that runs too long and a lost connection are each a
`StoreUnavailable` in bounded time, and the store serves again once the cause is gone.
The tests every store runs on both databases are in test_store_database.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_llm.store import Store, StoreUnavailable, open_store
from trio_llm.store.database import StoreError, Transaction, open_database

psycopg = pytest.importorskip("psycopg")


def _add_response(tx: Transaction, rid: str) -> None:
    tx.execute(
        "INSERT INTO responses (id, created_at, status, background, model, request, context, "
        "body, nbytes) VALUES (?, 1, 'completed', 0, 'm', '{}', '[]', '{}', 1)",
        (rid,),
    )


def _count(store: Store) -> int:
    return store.transaction_sync(lambda tx: tx.one("SELECT COUNT(*) FROM responses"))[0]


@pytest.fixture
def pg_store(postgres_store_url: str, tmp_path: Path) -> Iterator[Store]:
    store = open_store(postgres_store_url, tmp_path)
    yield store
    store.close()


@pytest.fixture
def other(postgres_store_url: str) -> Iterator:
    """Another client's connection to the store's database."""
    with psycopg.connect(postgres_store_url, autocommit=True) as connection:
        yield connection


async def test_a_table_locked_by_another_connection_is_store_unavailable(
    pg_store: Store, other, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trio_llm.store.database.POSTGRES_LOCK_TIMEOUT", 0.1)
    other.execute("BEGIN")
    other.execute("LOCK TABLE responses IN ACCESS EXCLUSIVE MODE")
    with pytest.raises(StoreUnavailable, match="lock timeout") as caught:
        await pg_store.transaction(lambda tx: _add_response(tx, "r1"))
    assert not caught.value.full
    other.execute("ROLLBACK")
    await pg_store.transaction(lambda tx: _add_response(tx, "r1"))
    assert _count(pg_store) == 1


async def test_a_row_locked_by_another_connection_is_store_unavailable(
    pg_store: Store, other, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trio_llm.store.database.POSTGRES_LOCK_TIMEOUT", 0.1)
    await pg_store.transaction(lambda tx: _add_response(tx, "r1"))
    other.execute("BEGIN")
    other.execute("SELECT id FROM responses WHERE id = 'r1' FOR UPDATE")

    def finish(tx: Transaction) -> int:
        return tx.execute("UPDATE responses SET status = 'failed' WHERE id = ?", ("r1",))

    with pytest.raises(StoreUnavailable, match="lock timeout"):
        await pg_store.transaction(finish)
    # Other rows are not held: the store serves them meanwhile.
    await pg_store.transaction(lambda tx: _add_response(tx, "r2"))
    other.execute("COMMIT")
    assert await pg_store.transaction(finish) == 1


async def test_a_statement_that_runs_too_long_is_store_unavailable(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trio_llm.store.database.POSTGRES_STATEMENT_TIMEOUT", 0.1)
    with pytest.raises(StoreUnavailable, match="statement timeout"):
        await pg_store.transaction(lambda tx: tx.one("SELECT pg_sleep(60)"))
    assert _count(pg_store) == 0  # the same connection serves on


def test_the_timeouts_are_set_on_every_transaction(pg_store: Store) -> None:
    settings = pg_store.transaction_sync(
        lambda tx: tuple(
            tx.one(
                "SELECT current_setting(?), current_setting(?)",
                ("lock_timeout", "statement_timeout"),
            )
        )
    )
    assert settings == ("5s", "30s")


async def test_a_lost_connection_is_store_unavailable_then_the_store_reconnects(
    pg_store: Store, other
) -> None:
    await pg_store.transaction(lambda tx: _add_response(tx, "r1"))
    # The server ends the store's (idle) connection: a restart, a failover, an operator.
    ended = other.execute(
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchall()
    # The store's one idle connection; the probe connection `open_database` closed may
    # still be listed while its backend exits (then terminating it answers False).
    assert (True,) in ended and set(ended) <= {(True,), (False,)}
    with pytest.raises(StoreUnavailable, match="unavailable"):
        await pg_store.transaction(lambda tx: _add_response(tx, "r2"))
    # The broken connection was dropped: the next unit of work opens a new one.
    await pg_store.transaction(lambda tx: _add_response(tx, "r2"))
    assert _count(pg_store) == 2


def test_an_error_in_the_sql_is_a_store_error_not_unavailable(pg_store: Store) -> None:
    with pytest.raises(StoreError, match="store error") as caught:
        pg_store.transaction_sync(lambda tx: tx.one("SELECT * FROM no_such_table"))
    assert not isinstance(caught.value, StoreUnavailable)
    assert _count(pg_store) == 0


def test_a_server_nobody_listens_on_is_refused_at_open(tmp_path: Path) -> None:
    # A port bound but never listened on: connections to it are refused.
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        url = f"postgresql://trio:secret@127.0.0.1:{port}/trio"
        with pytest.raises(StoreUnavailable, match="unavailable") as caught:
            open_database(url, tmp_path)
    assert "secret" not in str(caught.value)
