"""The Responses API's store side over an engine played by the test (no model): a server
without a store, a store that is locked when a response is written, a background response
refused by a full waiting line, cancelled mid-generation, and run again after a restart.

The engine is `FakeEngine` / `ScriptedEngine` over an in-memory stream, so each request's
outputs (and its abort) are exact, and nothing is timed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tests.unit.conftest import FakeEngine, ScriptedEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.responses.handlers import ResponsesAPI
from trio_llm.store import RetentionPolicy, Store, open_store, responses
from trio_llm.store.responses import StoredResponse
from trio_llm.store.retention import stored_bytes, sweep

BODY = {"model": "m", "input": "hi", "max_output_tokens": 5}


@asynccontextmanager
async def _client(
    smol_tokenizer,
    store: Store | None,
    fake: type[FakeEngine] = ScriptedEngine,
    max_background: int | None = None,
    **options: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    """An app over a fake engine (`ScriptedEngine` answers two tokens and stops) with
    ``store`` and its background responses running (at most ``max_background``)."""
    engine, stream = engine_client_pair()
    engine_side = ScriptedEngine(stream, [28, 28]) if fake is ScriptedEngine else fake(stream)
    serving = ModelServing(engine, smol_tokenizer, ("m",), **options)
    serving.store = store
    api = ResponsesAPI(serving, max_background)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(engine_side.run)
        await nursery.start(api.serve_background)
        app = build_app(serving, lambda: True, None, api)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, engine_side
        api.stop_background()
        nursery.cancel_scope.cancel()


async def _poll(client: httpx.AsyncClient, response_id: str, until: tuple[str, ...]) -> dict:
    while True:
        body = (await client.get(f"/v1/responses/{response_id}")).json()
        if body["status"] in until:
            return body
        await trio.sleep(0.01)


async def test_without_a_store_nothing_is_stored_and_stateful_fields_are_refused(
    smol_tokenizer,
) -> None:
    async with _client(smol_tokenizer, None) as (client, _):
        reply = await client.post("/v1/responses", json=BODY)
        assert reply.status_code == 200 and reply.json()["store"] is False
        for name, value in (
            ("store", True),
            ("background", True),
            ("previous_response_id", "resp_1"),
            ("conversation", "conv_1"),
        ):
            reply = await client.post("/v1/responses", json={**BODY, name: value})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == name and "--store-url none" in error["message"]
        assert (await client.get("/v1/responses/resp_1")).status_code == 404
        assert (await client.post("/v1/conversations", json={})).status_code == 404


async def test_a_locked_store_is_the_clients_error_not_a_crash(
    smol_tokenizer, sqlite_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite's lock (test_store_postgres and test_store_http_errors cover PostgreSQL's).
    monkeypatch.setattr("trio_llm.store.database.SQLITE_BUSY_TIMEOUT", 0.05)
    store = open_store(sqlite_store_url, tmp_path)
    other = sqlite3.connect(sqlite_store_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        async with _client(smol_tokenizer, store) as (client, _):
            other.execute("BEGIN EXCLUSIVE")
            reply = await client.post("/v1/responses", json=BODY)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "store_unavailable"
            streamed = await client.post("/v1/responses", json={**BODY, "stream": True})
            names = [
                line.removeprefix("event: ")
                for line in streamed.text.splitlines()
                if line.startswith("event: ")
            ]
            assert names[-1] == "error" and "response.completed" not in names
            assert "output_text.done" in " ".join(names)  # the answer itself was sent
            other.execute("ROLLBACK")
            reply = await client.post("/v1/responses", json=BODY)
            assert reply.status_code == 200
            stored = await client.get(f"/v1/responses/{reply.json()['id']}")
            assert stored.json() == reply.json()
    finally:
        other.close()
        store.close()


class _Silent(FakeEngine):
    """Takes requests and answers nothing until the test says so."""


async def test_a_full_waiting_line_fails_a_background_response(smol_tokenizer, store) -> None:
    async with _client(smol_tokenizer, store, _Silent, max_num_waiting_requests=1) as (
        client,
        fake,
    ):
        async with trio.open_nursery() as nursery:
            waiting = partial(client.post, "/v1/responses", json={**BODY, "store": False})
            nursery.start_soon(waiting)
            await fake.wait_for_requests(1)  # it waits for its first output: the line is full
            queued = (await client.post("/v1/responses", json={**BODY, "background": True})).json()
            assert queued["status"] == "queued" and queued["background"] is True
            failed = await _poll(client, queued["id"], ("failed",))
            assert failed["error"]["code"] == "too_many_waiting_requests"
            nursery.cancel_scope.cancel()


async def test_cancel_aborts_the_engine_request_and_keeps_the_partial_output(
    smol_tokenizer, store
) -> None:
    async with _client(smol_tokenizer, store, _Silent) as (client, fake):
        body = {**BODY, "background": True, "max_output_tokens": 50}
        queued = (await client.post("/v1/responses", json=body)).json()
        await fake.wait_for_requests(1)
        await _poll(client, queued["id"], ("in_progress",))
        (request_id,) = fake.added
        await fake.tokens(request_id, 3)
        await trio.testing.wait_all_tasks_blocked()  # the tokens reached the response
        cancelled = (await client.post(f"/v1/responses/{queued['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled"
        assert fake.aborted == [request_id]
        assert cancelled["usage"]["output_tokens"] == 3
        assert cancelled["output"][0]["content"][0]["text"] == smol_tokenizer.decode([28] * 3)
        again = (await client.post(f"/v1/responses/{queued['id']}/cancel")).json()
        assert again == cancelled  # idempotent
        foreground = _left_by_a_stopped_server("resp_fg", 0)
        foreground = foreground.with_body({**foreground.body, "background": False})
        store.transaction_sync(lambda tx: responses.insert(tx, foreground))
        reply = await client.post("/v1/responses/resp_fg/cancel")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_id"


def _left_by_a_stopped_server(response_id: str, resumed: int) -> StoredResponse:
    body = {
        "id": response_id,
        "object": "response",
        "created_at": 1,
        "status": "in_progress",
        "background": True,
        "model": "m",
        "output": [],
    }
    request = {**BODY, "background": True, "input": [{"role": "user", "content": "again"}]}
    context = [
        {"type": "message", "id": "msg_a", "role": "user", "content": "earlier"},
        {"type": "message", "id": "msg_b", "role": "user", "content": "again"},
    ]
    return StoredResponse(response_id, body, request, context, resumed)


async def test_background_responses_a_stopped_server_left_run_again(smol_tokenizer, store) -> None:
    def leave(tx) -> None:
        responses.insert(tx, _left_by_a_stopped_server("resp_left", 0))
        responses.insert(tx, _left_by_a_stopped_server("resp_twice", 1))

    store.transaction_sync(leave)
    async with _client(smol_tokenizer, store) as (client, _):
        done = await _poll(client, "resp_left", ("completed",))
        assert done["output"][0]["content"][0]["text"] == smol_tokenizer.decode([28, 28])
        failed = await _poll(client, "resp_twice", ("failed",))
        assert "the server stopped 2 times" in failed["error"]["message"]
        items = (await client.get("/v1/responses/resp_left/input_items?order=asc")).json()
        assert [item["id"] for item in items["data"]] == ["msg_a", "msg_b"]
    resumed = store.transaction_sync(lambda tx: responses.get(tx, "resp_left"))
    assert resumed.resumed == 1


async def test_unknown_fields_are_not_stored_so_they_evict_no_other_clients_objects(
    smol_tokenizer, store
) -> None:
    big = "x" * 2**20
    async with _client(smol_tokenizer, store) as (client, _):
        others = (await client.post("/v1/responses", json=BODY)).json()
        before = store.transaction_sync(stored_bytes)
        for _ in range(3):
            body = {**BODY, "junk": big, "text": {"format": {"type": "text"}, "pad": big}}
            reply = await client.post("/v1/responses", json=body)
            assert reply.status_code == 200, reply.text
        grown = store.transaction_sync(stored_bytes) - before
        assert grown < 3 * 8192, grown  # three small responses, not 6 MiB
        stored = store.transaction_sync(lambda tx: responses.get(tx, reply.json()["id"]))
        assert "junk" not in stored.request and stored.request["text"] == {
            "format": {"type": "text"}
        }
        # A store with 1 MiB to spare keeps the other client's response.
        policy = RetentionPolicy(max_age=None, max_bytes=before + 2**20)
        assert store.transaction_sync(lambda tx: sweep(tx, policy)) == []
        assert (await client.get(f"/v1/responses/{others['id']}")).json() == others
