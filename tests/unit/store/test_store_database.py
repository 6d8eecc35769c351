"""The store's database layer on SQLite and PostgreSQL (`store_url` runs each test on
both): migrations, transactions, the errors a locked, full or unusable database gives,
and retention with its tombstones. PostgreSQL's own failure modes are in
test_store_postgres.py."""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from tests.support.store_faults import fill_sqlite_to_the_brim
from trio_llm.cli.types import parse_duration, parse_size_or_none
from trio_llm.store import RetentionPolicy, Store, StoreUnavailable, open_store
from trio_llm.store.database import StoreError, Transaction, open_database, redact
from trio_llm.store.migrations import MIGRATIONS, SCHEMA_VERSION, migrate, schema_version
from trio_llm.store.objects import Evicted, NotFound, missing, page_after
from trio_llm.store.retention import format_duration, stored_bytes, sweep

T = TypeVar("T")
R = TypeVar("R")


def _add_response(tx: Transaction, rid: str, created_at: int, status: str, size: int) -> None:
    tx.execute(
        "INSERT INTO responses (id, created_at, status, background, model, request, context, "
        "body, nbytes) VALUES (?, ?, ?, 0, 'm', '{}', '[]', '{}', ?)",
        (rid, created_at, status, size),
    )


def table_names(tx: Transaction) -> set[str]:
    """The tables of the store's database (in PostgreSQL's current schema)."""
    if tx.dialect == "sqlite":
        return {r[0] for r in tx.rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
    query = "SELECT table_name FROM information_schema.tables WHERE table_schema = ?"
    return {r[0] for r in tx.rows(query, ("public",))}


def at_once(call: Callable[[T], R], each: Sequence[T]) -> list[R | BaseException]:
    """``call(x)`` for each ``x`` of ``each``, each in a thread of its own, all released
    together (a barrier); what each returned or raised, in the order they ended."""
    ready = threading.Barrier(len(each))
    results: list[R | BaseException] = []

    def run(x: T) -> None:
        ready.wait()
        try:
            results.append(call(x))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(x,)) for x in each]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_migrations_run_once_and_a_newer_schema_is_refused(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url, tmp_path)
    assert store.files_dir == tmp_path / "store" / "files" and store.files_dir.is_dir()
    assert store.transaction_sync(schema_version) == SCHEMA_VERSION == len(MIGRATIONS)
    assert migrate(store.database) == (SCHEMA_VERSION, SCHEMA_VERSION)
    tables = store.transaction_sync(table_names)
    assert {"responses", "conversations", "files", "batches", "batch_results"} <= tables
    assert "store_schema" in tables
    store.transaction_sync(
        lambda tx: tx.execute("INSERT INTO store_schema VALUES (?)", (SCHEMA_VERSION + 1,))
    )
    store.close()
    with pytest.raises(StoreError, match="newer than this server"):
        open_store(store_url, tmp_path)


def test_two_servers_migrating_at_once_apply_each_migration_once(store_url: str, tmp_path: Path):
    # Two replicas starting together on one new database (PostgreSQL: the advisory lock;
    # SQLite: BEGIN IMMEDIATE). Without the lock PostgreSQL refuses the second CREATE
    # TABLE of store_schema (a duplicate key in its catalog).
    databases = [open_database(store_url, tmp_path) for _ in range(2)]
    results = at_once(migrate, databases)
    try:
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert sorted(results) == [(0, SCHEMA_VERSION), (SCHEMA_VERSION, SCHEMA_VERSION)]
        versions = databases[0].transaction_sync(
            lambda tx: [r[0] for r in tx.rows("SELECT version FROM store_schema ORDER BY 1")]
        )
        assert versions == list(range(1, SCHEMA_VERSION + 1))
    finally:
        for database in databases:
            database.close()


def test_sql_is_written_once_for_both_databases(store: Store) -> None:
    # ``?`` placeholders everywhere; a literal % is not one of psycopg's placeholders.
    row = store.transaction_sync(lambda tx: tx.one("SELECT ? || '%', '100%'", ("50",)))
    assert tuple(row) == ("50%", "100%")
    assert store.transaction_sync(lambda tx: tx.one("SELECT '%s'"))[0] == "%s"


def test_a_failed_unit_of_work_leaves_nothing(store: Store) -> None:
    def half_done(tx: Transaction) -> None:
        _add_response(tx, "resp_1", 1, "completed", 10)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        store.transaction_sync(half_done)
    assert store.transaction_sync(lambda tx: tx.one("SELECT COUNT(*) FROM responses"))[0] == 0


async def test_a_sqlite_file_locked_by_another_writer_is_store_unavailable(
    sqlite_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL's counterpart (a table locked by another connection): test_store_postgres.
    monkeypatch.setattr("trio_llm.store.database.SQLITE_BUSY_TIMEOUT", 0.05)
    store = open_store(sqlite_store_url, tmp_path)
    other = sqlite3.connect(tmp_path / "store" / "store.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with pytest.raises(StoreUnavailable, match="busy") as caught:
        await store.transaction(lambda tx: _add_response(tx, "r", 1, "completed", 1))
    assert not caught.value.full
    other.execute("ROLLBACK")
    other.close()
    await store.transaction(lambda tx: _add_response(tx, "r", 1, "completed", 1))
    store.close()


def test_a_full_sqlite_disk_is_store_unavailable_and_reads_go_on(
    sqlite_store_url: str, tmp_path: Path
) -> None:
    store = open_store(sqlite_store_url, tmp_path)
    store.transaction_sync(lambda tx: _add_response(tx, "kept", 1, "completed", 1))
    fill_sqlite_to_the_brim(store)

    def big_write(tx: Transaction) -> None:
        _add_response(tx, "small", 2, "completed", 1)
        tx.execute("UPDATE responses SET body = ? WHERE id = 'small'", ("x" * 100_000,))

    with pytest.raises(StoreUnavailable, match="full") as caught:
        store.transaction_sync(big_write)
    assert caught.value.full
    # Nothing of the failed unit of work is left; what was stored before still reads.
    ids = store.transaction_sync(lambda tx: [r[0] for r in tx.rows("SELECT id FROM responses")])
    assert ids == ["kept"]
    store.close()


async def test_transactions_from_many_tasks_all_land(store: Store) -> None:
    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(
                store.transaction, lambda tx, i=i: _add_response(tx, f"r{i}", i, "completed", 1)
            )
    assert store.transaction_sync(lambda tx: tx.one("SELECT COUNT(*) FROM responses"))[0] == 20


def test_bad_urls_are_refused_with_the_flag_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--store-url"):
        open_database("mysql://x/y", tmp_path)
    for url in ("sqlite:///", "sqlite://host/store.db", "sqlite:///folder/"):
        with pytest.raises(ValueError, match=r"--store-url.*naming a file"):
            open_database(url, tmp_path)
    assert redact("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"


def test_sqlite_paths_follow_sqlalchemy_relative_then_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sqlite:///relative is relative to the working directory (the root is never touched);
    # sqlite:////absolute is absolute.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = f"trio-llm-test-{uuid.uuid4().hex}"
    try:
        database = open_database(f"sqlite:///{name}/store.db", tmp_path)
        database.close()
        assert database.folder == work / name and (work / name / "store.db").is_file()
    finally:
        shutil.rmtree(Path("/", name), ignore_errors=True)  # made by an older server
    assert not Path("/", name).exists()
    database = open_database(f"sqlite:///{tmp_path}/abs/store.db", tmp_path)  # 4 slashes
    database.close()
    assert database.folder == tmp_path / "abs"
    # An older server's store at /PATH, spelt sqlite:///PATH then: refused, not replaced.
    with pytest.raises(ValueError, match=f"sqlite:///{tmp_path}/abs/store.db"):
        open_database(f"sqlite://{tmp_path}/abs/store.db", tmp_path)


def test_a_store_whose_folder_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    for url in (f"sqlite:///{tmp_path}/afile/store.db", f"sqlite:///{tmp_path}/afile/x/s.db"):
        with pytest.raises(StoreError, match=f"{tmp_path}/afile is a file, not a folder"):
            open_store(url, tmp_path)
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "files").write_text("where the store's files would go")
    with pytest.raises(StoreError, match="files is a file, not a folder"):
        open_store(f"sqlite:///{tmp_path}/db/store.db", tmp_path)


def test_retention_evicts_by_age_then_size_and_leaves_tombstones(
    store_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    day = 86400
    policy = RetentionPolicy(max_age=2 * day, max_bytes=250)
    store = open_store(store_url, tmp_path, policy)
    request.addfinalizer(store.close)

    def fill(tx: Transaction) -> None:
        _add_response(tx, "old", 10 * day - 3 * day, "completed", 100)
        _add_response(tx, "running", 10 * day - 3 * day, "in_progress", 100)
        for i in range(3):
            _add_response(tx, f"new{i}", 10 * day - 100 + i, "completed", 100)

    store.transaction_sync(fill)
    removed = store.transaction_sync(lambda tx: sweep(tx, policy, at=10 * day))
    # "old" by age; then the oldest finished one by size (100 running + 300 > 250).
    assert removed == [("response", "old"), ("response", "new0"), ("response", "new1")]
    assert store.transaction_sync(stored_bytes) == 200
    ids = store.transaction_sync(
        lambda tx: sorted(r[0] for r in tx.rows("SELECT id FROM responses"))
    )
    assert ids == ["new2", "running"]
    aged = store.transaction_sync(lambda tx: missing(tx, "response", "old"))
    assert isinstance(aged, Evicted) and "--store-retention 2d" in str(aged)
    sized = store.transaction_sync(lambda tx: missing(tx, "response", "new0"))
    assert isinstance(sized, Evicted) and "--store-max-size" in str(sized)
    never = store.transaction_sync(lambda tx: missing(tx, "response", "nope"))
    assert type(never) is NotFound and "no response with id 'nope'" in str(never)


def test_replicas_sweeping_at_once_evict_each_object_once(store_url: str, tmp_path: Path) -> None:
    # Every replica on one PostgreSQL store runs the retention sweep: two at the same
    # moment both succeed, and what they evict is evicted once, with one tombstone each.
    day = 86400
    policy = RetentionPolicy(max_age=2 * day, max_bytes=None)
    stores = [open_store(store_url, tmp_path / f"replica{i}", policy) for i in range(2)]

    def fill(tx: Transaction) -> None:
        for i in range(50):
            _add_response(tx, f"old{i:02}", 5 * day - 3 * day, "completed", 1)
        _add_response(tx, "new", 5 * day, "completed", 1)

    stores[0].transaction_sync(fill)
    removed = at_once(
        lambda store: store.transaction_sync(lambda tx: sweep(tx, policy, at=5 * day)), stores
    )
    try:
        assert not [r for r in removed if isinstance(r, BaseException)], removed
        old = {("response", f"old{i:02}") for i in range(50)}
        assert set().union(*removed) == old  # type: ignore[arg-type]
        left = stores[1].transaction_sync(
            lambda tx: [r[0] for r in tx.rows("SELECT id FROM responses")]
        )
        assert left == ["new"]
        tombstones = stores[1].transaction_sync(
            lambda tx: tx.one("SELECT COUNT(*), COUNT(DISTINCT id) FROM evicted")
        )
        assert tuple(tombstones) == (50, 50)
    finally:
        for store in stores:
            store.close()


def test_durations_sizes_and_pages() -> None:
    assert parse_duration("30d") == 30 * 86400 and parse_duration("90m") == 5400
    assert parse_duration("15") == 15 and parse_duration("0") is None
    assert parse_size_or_none("10GiB") == 10 * 2**30 and parse_size_or_none("none") is None
    for bad in ("soon", "-1d"):
        with pytest.raises(argparse.ArgumentTypeError, match="duration"):
            parse_duration(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        parse_size_or_none("10 parsecs")
    assert format_duration(30 * 86400) == "30d" and format_duration(5400) == "90m"
    assert format_duration(61) == "61s"
    items = [{"id": f"i{n}"} for n in range(5)]
    page = page_after(items, None, 2, "desc")
    assert [i["id"] for i in page.data] == ["i4", "i3"] and page.has_more
    page = page_after(items, "i3", 10, "desc")
    assert [i["id"] for i in page.data] == ["i2", "i1", "i0"] and not page.has_more
    assert page.body()["first_id"] == "i2" and page.body()["last_id"] == "i0"
    with pytest.raises(NotFound):
        page_after(items, "x", 2, "asc")
