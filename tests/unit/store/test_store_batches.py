"""The store's batches (`trio_llm.store.batches`) on the `store` fixture: the life of a
batch, each line recorded once, counts from the results, the result files."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from trio_llm.store import NotFound, RetentionPolicy, Store
from trio_llm.store import batches as stored
from trio_llm.store import files as stored_files
from trio_llm.store.retention import sweep


def _input_file(store: Store, purpose: str = "batch") -> str:
    file_id = stored_files.new_file_id()
    nbytes = stored_files.write_file(store.files_dir, file_id, [b'{"custom_id": "a"}\n'])
    store.transaction_sync(
        partial(
            stored_files.insert_file,
            file_id=file_id,
            filename="in.jsonl",
            purpose=purpose,
            nbytes=nbytes,
            created_at=1,
            expires_at=None,
        )
    )
    return file_id


def _create(store: Store, at: int = 1000, **fields: Any) -> dict[str, Any]:
    args = {
        "input_file_id": fields.pop("input_file_id", None) or _input_file(store),
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"k": "v"},
        "at": at,
    }
    return store.transaction_sync(partial(stored.create_batch, **(args | fields)))


def _get(store: Store, batch_id: str) -> dict[str, Any]:
    return store.transaction_sync(partial(stored.get_batch, batch_id=batch_id))


def test_a_new_batch_is_openais_batch_object_validating(store: Store) -> None:
    batch = _create(store, at=1000)
    assert batch["id"].startswith("batch_") and batch["object"] == "batch"
    assert batch["status"] == "validating"
    assert batch["expires_at"] == 1000 + 86400
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"k": "v"}
    for key in ("in_progress_at", "finalizing_at", "completed_at", "cancelled_at", "errors"):
        assert batch[key] is None
    assert _get(store, batch["id"]) == batch


def test_a_batch_needs_a_stored_input_file_of_purpose_batch(store: Store) -> None:
    with pytest.raises(NotFound, match="file-nope"):
        _create(store, input_file_id="file-nope")
    other = _input_file(store, purpose="user_data")
    with pytest.raises(stored.BatchConflict, match="purpose 'user_data'") as caught:
        _create(store, input_file_id=other)
    assert caught.value.param == "input_file_id"


def test_each_line_is_recorded_once_and_counts_come_from_the_results(store: Store) -> None:
    batch = _create(store)
    bid = batch["id"]
    assert store.transaction_sync(partial(stored.start_batch, batch_id=bid, total=4, at=1001))
    record = partial(stored.record_result, batch_id=bid)
    assert store.transaction_sync(partial(record, line=2, ok=True, result='{"n":2}'))
    assert store.transaction_sync(partial(record, line=0, ok=False, result='{"n":0}'))
    # The same line again (a line run twice around a crash) changes nothing.
    assert not store.transaction_sync(partial(record, line=2, ok=False, result='{"n":"again"}'))
    running = _get(store, bid)
    assert running["status"] == "in_progress" and running["in_progress_at"] == 1001
    assert running["request_counts"] == {"total": 4, "completed": 1, "failed": 1}
    assert store.transaction_sync(partial(stored.recorded_lines, batch_id=bid)) == {0, 2}
    assert store.transaction_sync(partial(stored.results, batch_id=bid)) == [
        (0, False, '{"n":0}'),
        (2, True, '{"n":2}'),
    ]


def test_the_result_files_hold_every_line_in_order_and_the_batch_ends(store: Store) -> None:
    bid = _create(store)["id"]
    store.transaction_sync(partial(stored.start_batch, batch_id=bid, total=5))
    for line in (4, 1, 0, 3, 2):  # recorded out of order, as concurrent lines finish
        result = json.dumps({"line": line})
        store.transaction_sync(
            partial(stored.record_result, batch_id=bid, line=line, ok=line != 3, result=result)
        )
    assert store.transaction_sync(partial(stored.begin_finalizing, batch_id=bid, at=2000))
    files = stored.write_result_files(store.transaction_sync, store.files_dir, bid)
    output_id, output_bytes = files["output"]
    error_id, _ = files["error"]
    assert output_id == stored.output_file_id(bid, "output") != error_id
    output = (store.files_dir / output_id).read_text().splitlines()
    assert [json.loads(line)["line"] for line in output] == [0, 1, 2, 4]
    assert output_bytes == (store.files_dir / output_id).stat().st_size
    errors = (store.files_dir / error_id).read_text().splitlines()
    assert [json.loads(line)["line"] for line in errors] == [3]

    done = store.transaction_sync(
        partial(
            stored.finish_batch,
            batch_id=bid,
            status="completed",
            files=files,
            expires_at=9999,
            at=2001,
        )
    )
    assert done["status"] == "completed" and done["completed_at"] == 2001
    assert done["finalizing_at"] == 2000
    assert (done["output_file_id"], done["error_file_id"]) == (output_id, error_id)
    assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    assert _get(store, bid) == done  # the counts are frozen: the results are gone
    assert store.transaction_sync(partial(stored.results, batch_id=bid)) == []
    output_file = store.transaction_sync(partial(stored_files.get_file, file_id=output_id))
    assert output_file["purpose"] == "batch_output" and output_file["expires_at"] == 9999
    assert output_file["filename"] == f"{bid}_output.jsonl"
    # Finishing again (a restart between the files and the status) changes nothing.
    again = store.transaction_sync(
        partial(stored.finish_batch, batch_id=bid, status="cancelled", files={}, expires_at=None)
    )
    assert again == done


def test_no_file_is_made_for_a_kind_no_line_went_to(store: Store) -> None:
    bid = _create(store)["id"]
    store.transaction_sync(partial(stored.start_batch, batch_id=bid, total=1))
    store.transaction_sync(
        partial(stored.record_result, batch_id=bid, line=0, ok=True, result="{}")
    )
    files = stored.write_result_files(store.transaction_sync, store.files_dir, bid)
    assert files["error"] is None and files["output"] is not None
    assert sorted(
        p.name for p in store.files_dir.iterdir() if p.name.startswith("file-")
    ) == sorted(
        [
            store.transaction_sync(partial(stored.get_batch, batch_id=bid))["input_file_id"],
            files["output"][0],
        ]
    )


def test_cancel_moves_a_running_batch_to_cancelling_and_refuses_a_finished_one(
    store: Store,
) -> None:
    bid = _create(store)["id"]
    cancelling = store.transaction_sync(partial(stored.request_cancel, batch_id=bid, at=1500))
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] == 1500
    # A cancel in the meantime: validation's outcome no longer applies.
    assert not store.transaction_sync(partial(stored.start_batch, batch_id=bid, total=3))
    assert not store.transaction_sync(partial(stored.fail_batch, batch_id=bid, errors=[]))
    assert store.transaction_sync(partial(stored.request_cancel, batch_id=bid)) == cancelling
    store.transaction_sync(
        partial(stored.finish_batch, batch_id=bid, status="cancelled", files={}, expires_at=None)
    )
    with pytest.raises(stored.BatchConflict, match="is cancelled"):
        store.transaction_sync(partial(stored.request_cancel, batch_id=bid))
    with pytest.raises(NotFound):
        store.transaction_sync(partial(stored.request_cancel, batch_id="batch_nope"))


def test_a_failed_validation_lists_its_errors(store: Store) -> None:
    bid = _create(store)["id"]
    errors = [{"code": "duplicate_custom_id", "message": "m", "param": "custom_id", "line": 2}]
    assert store.transaction_sync(partial(stored.fail_batch, batch_id=bid, errors=errors, at=7))
    failed = _get(store, bid)
    assert failed["status"] == "failed" and failed["failed_at"] == 7
    assert failed["errors"] == {"object": "list", "data": errors}


def test_batches_list_newest_first_and_active_ones_are_found(store: Store) -> None:
    made = [_create(store, at=1000 + i)["id"] for i in range(3)]
    first = store.transaction_sync(partial(stored.list_batches, limit=2, after=None))
    assert [b["id"] for b in first.data] == [made[2], made[1]] and first.has_more
    rest = store.transaction_sync(partial(stored.list_batches, limit=2, after=made[1]))
    assert [b["id"] for b in rest.data] == [made[0]] and not rest.has_more
    store.transaction_sync(partial(stored.fail_batch, batch_id=made[1], errors=[]))
    active = store.transaction_sync(stored.active_batches)
    assert [b["id"] for b in active] == [made[0], made[2]]
    assert store.transaction_sync(partial(stored.batch_status, batch_id=made[1])) == "failed"
    assert store.transaction_sync(partial(stored.batch_status, batch_id="batch_x")) is None


def test_retention_keeps_a_running_batch_and_its_input_file(store: Store) -> None:
    running = _create(store, at=10)
    finished = _create(store, at=10)
    store.transaction_sync(partial(stored.fail_batch, batch_id=finished["id"], errors=[]))
    removed = store.transaction_sync(
        partial(sweep, policy=RetentionPolicy(max_age=60, max_bytes=None), at=100_000)
    )
    assert ("batch", running["id"]) not in removed
    assert ("file", running["input_file_id"]) not in removed
    assert {("batch", finished["id"]), ("file", finished["input_file_id"])} <= set(removed)
    assert _get(store, running["id"])["status"] == "validating"
