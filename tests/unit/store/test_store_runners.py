"""Which server runs what (`trio_llm.store.runners`), on SQLite and PostgreSQL: two
servers on one store (two `Store`s opened on one database, as replicas are) never both
run one background response or batch; a server that stops, goes silent or dies (its
process gone) leaves its work to the others, who take each piece over once."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.store.test_store_batches import _create
from tests.unit.store.test_store_responses import _response
from trio_llm.store import Store, open_store, responses, runners
from trio_llm.store import batches as stored
from trio_llm.store.responses import StoredResponse
from trio_llm.store.runners import STALE_SECONDS, Runner


@pytest.fixture
def other(store_url: str, tmp_path: Path, store: Store) -> Iterator[Store]:
    """A second server's store on the database of ``store`` (opened after it)."""
    opened = open_store(store_url, tmp_path)
    yield opened
    opened.close()


def _background(store: Store, response_id: str = "resp_bg") -> StoredResponse:
    """A queued background response that ``store``'s server runs."""
    response = replace(_response(response_id, "queued", background=True), runner=store.runner.id)
    store.transaction_sync(lambda tx: responses.insert(tx, response))
    return response


def _left(store: Store) -> list[str]:
    """The ids of the background responses ``store``'s server would take over now."""
    return [r.id for r in store.transaction_sync(lambda tx: responses.unfinished(tx, store.runner))]


def test_a_running_servers_response_is_left_to_it_until_it_stops(
    store: Store, other: Store
) -> None:
    _background(store)
    assert _left(other) == [] and _left(store) == []  # its own is running here
    store.close()  # a clean stop forgets the runner: at once
    assert _left(other) == ["resp_bg"]


def test_a_silent_server_is_gone_after_the_stale_time(store: Store, other: Store) -> None:
    _background(store)
    now = time.time()
    live_later = other.transaction_sync(
        lambda tx: runners.live(tx, other.runner, now + STALE_SECONDS + 1)
    )
    assert store.runner.id not in live_later and other.runner.id in live_later
    # A heartbeat keeps it.
    store.transaction_sync(lambda tx: runners.beat(tx, store.runner, now + STALE_SECONDS))
    live_then = other.transaction_sync(
        lambda tx: runners.live(tx, other.runner, now + STALE_SECONDS + 1)
    )
    assert store.runner.id in live_then


def test_a_dead_process_on_this_machine_is_gone_at_once(store: Store, other: Store) -> None:
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = Runner("killed-server", other.runner.machine, int(exited.stdout))
    store.transaction_sync(lambda tx: runners.register(tx, dead))
    elsewhere = Runner("other-machine", "another boot/pid:[1]", int(exited.stdout))
    store.transaction_sync(lambda tx: runners.register(tx, elsewhere))
    running = other.transaction_sync(lambda tx: runners.live(tx, other.runner))
    # Its heartbeat is fresh, but its process is gone; the other machine's process
    # cannot be looked at from here: its heartbeat decides.
    assert "killed-server" not in running and "other-machine" in running
    assert store.runner.id in running  # the same process: the heartbeat decides


def test_two_servers_taking_over_one_response_race_and_one_wins(
    store: Store, other: Store, store_url: str, tmp_path: Path
) -> None:
    left = _background(store)
    store.close()
    third = open_store(store_url, tmp_path)
    try:
        takers = []
        for server in (other, third):
            taken = StoredResponse(
                left.id,
                {**left.body, "status": "queued"},
                left.request,
                left.context,
                resumed=1,
                runner=server.runner.id,
            )
            takers.append(
                server.transaction_sync(
                    lambda tx, taken=taken: responses.update(
                        tx, taken, taking_over_from=left.runner
                    )
                )
            )
        assert takers == [True, False]
        found = other.transaction_sync(lambda tx: responses.get(tx, left.id))
        assert found.runner == other.runner.id and found.resumed == 1
        # The server that lost the response can no longer write it.
        late = StoredResponse(
            left.id,
            {**left.body, "status": "completed"},
            left.request,
            left.context,
            runner=third.runner.id,
        )
        assert not third.transaction_sync(lambda tx: responses.update(tx, late))
        assert _left(third) == []  # the taker runs it
    finally:
        third.close()


def test_each_batch_is_claimed_by_one_server(store: Store, other: Store) -> None:
    first = _create(store)
    mine = store.transaction_sync(lambda tx: stored.claim_batches(tx, store.runner))
    assert [b["id"] for b in mine] == [first["id"]]
    assert other.transaction_sync(lambda tx: stored.claim_batches(tx, other.runner)) == []
    second = _create(store, at=2000)
    theirs = other.transaction_sync(lambda tx: stored.claim_batches(tx, other.runner))
    assert [b["id"] for b in theirs] == [second["id"]]  # new and unclaimed: the first asker's
    mine = store.transaction_sync(lambda tx: stored.claim_batches(tx, store.runner))
    assert [b["id"] for b in mine] == [first["id"]]
    other.close()  # its batch goes to the server that is left
    mine = store.transaction_sync(lambda tx: stored.claim_batches(tx, store.runner))
    assert [b["id"] for b in mine] == [first["id"], second["id"]]
