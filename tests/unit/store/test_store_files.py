"""The store's files (`trio_llm.store.files`) on the `store` fixture: contents written
through a temporary name, rows, pages, deletion and what retention counts."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import pytest

from trio_llm.store import NotFound, RetentionPolicy, Store
from trio_llm.store import batches as stored_batches
from trio_llm.store import files as stored
from trio_llm.store.retention import stored_bytes, sweep


def _add(
    store: Store, data: bytes, *, purpose: str = "batch", at: int = 100, name: str = "a.jsonl"
):
    file_id = stored.new_file_id()
    nbytes = stored.write_file(store.files_dir, file_id, [data[:3], data[3:]])
    insert = partial(
        stored.insert_file,
        file_id=file_id,
        filename=name,
        purpose=purpose,
        nbytes=nbytes,
        created_at=at,
        expires_at=at + 10,
    )
    return store.transaction_sync(insert)


def test_a_file_is_written_then_named_and_its_row_is_openais_file_object(store: Store) -> None:
    writer = stored.FileWriter(store.files_dir, "file-1", max_bytes=10)
    writer.write(b"hello ")
    assert not (store.files_dir / "file-1").exists()  # only the temporary name so far
    writer.write(b"you")
    assert writer.finish() == 9
    assert (store.files_dir / "file-1").read_bytes() == b"hello you"
    assert [p.name for p in store.files_dir.iterdir()] == ["file-1"]
    row = store.transaction_sync(
        partial(
            stored.insert_file,
            file_id="file-1",
            filename="é.jsonl",
            purpose="batch",
            nbytes=9,
            created_at=5,
            expires_at=None,
        )
    )
    assert row == {
        "id": "file-1",
        "object": "file",
        "bytes": 9,
        "created_at": 5,
        "expires_at": None,
        "filename": "é.jsonl",
        "purpose": "batch",
        "status": "processed",
    }
    assert store.transaction_sync(partial(stored.get_file, file_id="file-1")) == row


def test_a_file_over_the_limit_is_refused_and_leaves_nothing(store: Store) -> None:
    writer = stored.FileWriter(store.files_dir, "file-2", max_bytes=4)
    writer.write(b"abcd")
    with pytest.raises(stored.FileTooLarge, match="limit of 4 bytes"):
        writer.write(b"e")
    writer.discard()
    assert list(store.files_dir.iterdir()) == []


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden"])
def test_ids_that_could_leave_the_folder_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        stored.content_path(tmp_path, bad)


def test_files_list_by_purpose_in_either_order_a_page_at_a_time(store: Store) -> None:
    made = [_add(store, b"x" * (i + 1), at=100 + i) for i in range(5)]
    _add(store, b"user", purpose="user_data", at=103)

    def page(**query):
        args = {"purpose": "batch", "limit": 2, "order": "desc", "after": None} | query
        return store.transaction_sync(partial(stored.list_files, **args))

    first = page()
    assert [f["id"] for f in first.data] == [made[4]["id"], made[3]["id"]] and first.has_more
    second = page(after=first.data[-1]["id"])
    assert [f["id"] for f in second.data] == [made[2]["id"], made[1]["id"]] and second.has_more
    last = page(after=second.data[-1]["id"])
    assert [f["id"] for f in last.data] == [made[0]["id"]] and not last.has_more
    ascending = page(order="asc", limit=10)
    assert [f["id"] for f in ascending.data] == [f["id"] for f in made]
    assert len(page(purpose=None, limit=10).data) == 6
    with pytest.raises(NotFound):
        page(after="file-unknown")


def test_deleting_a_file_in_use_by_a_running_batch_is_refused(store: Store) -> None:
    source = _add(store, b'{"custom_id": "a"}\n')
    batch = store.transaction_sync(
        partial(
            stored_batches.create_batch,
            input_file_id=source["id"],
            endpoint="/v1/completions",
            completion_window="24h",
            metadata=None,
        )
    )

    def delete(tx) -> None:
        stored.delete_file(tx, source["id"], stored_batches.files_in_use(tx))

    with pytest.raises(stored.FileInUse, match=batch["id"]):
        store.transaction_sync(delete)
    store.transaction_sync(partial(stored_batches.request_cancel, batch_id=batch["id"]))
    store.transaction_sync(
        partial(
            stored_batches.finish_batch,
            batch_id=batch["id"],
            status="cancelled",
            files={},
            expires_at=None,
        )
    )
    store.transaction_sync(delete)
    with pytest.raises(NotFound):
        store.transaction_sync(partial(stored.get_file, file_id=source["id"]))


def test_file_bytes_count_towards_the_store_and_old_files_are_evicted(store: Store) -> None:
    old = _add(store, b"a" * 1000, at=10)
    new = _add(store, b"b" * 10, at=10_000)
    assert store.transaction_sync(stored_bytes) == 1010
    removed = store.transaction_sync(
        partial(sweep, policy=RetentionPolicy(max_age=None, max_bytes=500), at=10_001)
    )
    assert removed == [("file", old["id"])]
    assert store.transaction_sync(partial(stored.get_file, file_id=new["id"]))["bytes"] == 10


def test_orphaned_contents_and_partial_files_are_removed_once_old(store: Store) -> None:
    kept = _add(store, b"data")
    orphan = store.files_dir / "file-orphan"
    orphan.write_bytes(b"no row")
    partial_file = store.files_dir / f".file-x{stored.PARTIAL_SUFFIX}"
    partial_file.write_bytes(b"half")
    fresh = store.files_dir / "file-fresh"
    fresh.write_bytes(b"being recorded now")
    old = time.time() - 2 * stored.ORPHAN_AGE
    for path in (orphan, partial_file):
        os.utime(path, (old, old))
    assert store.transaction_sync(partial(stored.remove_orphans, files_dir=store.files_dir)) == 2
    assert sorted(p.name for p in store.files_dir.iterdir()) == sorted([kept["id"], "file-fresh"])
