"""What a client sees when the store fails: a full disk answers 507 and a database
locked by another process 503 with ``Retry-After``, each with OpenAI's error body, never
a 500; the server keeps serving other requests, and the store's own once the cause is
gone.

The app is the real one (`build_app`, its exception handlers and middleware) around a
fake engine, with a store on a SQLite file and two test routes that read and write a
stored response through it as the store's endpoints do (`Store.transaction`, a
`StoreError` left to the app's handler).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from fastapi import FastAPI, Request

from tests.support.store_faults import fill_sqlite_to_the_brim, sqlite_locked_by_another_process
from tests.unit.conftest import FakeEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import RETRY_AFTER_SECONDS
from trio_llm.store import Store, Transaction, open_store
from trio_llm.store.objects import missing

ROUTE = "/test/stored/{response_id}"


def _add_store_routes(app: FastAPI, serving: ModelServing) -> None:
    """``POST`` stores the request's body as a response's; ``GET`` returns it."""

    async def write(response_id: str, request: Request) -> dict:
        body = (await request.body()).decode()

        def insert(tx: Transaction) -> None:
            tx.execute(
                "INSERT INTO responses (id, created_at, status, background, model, request, "
                "context, body, nbytes) VALUES (?, 1, 'completed', 0, 'm', '{}', '[]', ?, ?)",
                (response_id, body, len(body)),
            )

        assert serving.store is not None
        await serving.store.transaction(insert)
        return {"id": response_id}

    async def read(response_id: str) -> dict:
        def select(tx: Transaction) -> str:
            row = tx.one("SELECT body FROM responses WHERE id = ?", (response_id,))
            if row is None:
                raise missing(tx, "response", response_id)
            return row[0]

        assert serving.store is not None
        return {"id": response_id, "body": await serving.store.transaction(select)}

    app.add_api_route(ROUTE, write, methods=["POST"])
    app.add_api_route(ROUTE, read, methods=["GET"])


@asynccontextmanager
async def _client(store: Store, smol_tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app with ``store`` as its store."""
    engine, stream = engine_client_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(FakeEngine(stream).run)
        serving = ModelServing(engine, smol_tokenizer, ("m",))
        serving.store = store
        app = build_app(serving, lambda: True)
        _add_store_routes(app, serving)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
        nursery.cancel_scope.cancel()


async def _serves_the_rest(client: httpx.AsyncClient) -> None:
    """Requests that do not need the store still succeed."""
    assert (await client.get("/health")).status_code == 200
    models = await client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"


async def test_a_full_disk_answers_507_and_the_server_serves_on(
    sqlite_store_url: str, tmp_path: Path, smol_tokenizer
) -> None:
    store = open_store(sqlite_store_url, tmp_path)
    async with _client(store, smol_tokenizer) as client:
        assert (await client.post("/test/stored/kept", content="a")).status_code == 200
        fill_sqlite_to_the_brim(store)
        full = await client.post("/test/stored/big", content="x" * 100_000)
        assert full.status_code == 507
        error = full.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "store_unavailable"
        assert "database or disk is full" in error["message"]
        assert "retry-after" not in full.headers  # waiting does not free the disk
        await _serves_the_rest(client)
        kept = await client.get("/test/stored/kept")
        assert kept.status_code == 200 and kept.json()["body"] == "a"
        gone = await client.get("/test/stored/big")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    store.close()


@pytest.mark.slow  # the lock is held by another process
async def test_a_database_locked_by_another_process_answers_503_with_retry_after(
    sqlite_store_url: str, tmp_path: Path, smol_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trio_llm.store.database.SQLITE_BUSY_TIMEOUT", 0.05)
    store = open_store(sqlite_store_url, tmp_path)
    async with _client(store, smol_tokenizer) as client:
        with sqlite_locked_by_another_process(tmp_path / "store" / "store.db"):
            for busy in (
                await client.post("/test/stored/r1", content="a"),
                await client.get("/test/stored/r1"),
            ):
                assert busy.status_code == 503
                assert busy.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
                error = busy.json()["error"]
                assert error["type"] == "server_error" and error["code"] == "store_unavailable"
                assert "database is locked" in error["message"]
            await _serves_the_rest(client)
        # The lock is gone: the client's retry succeeds.
        assert (await client.post("/test/stored/r1", content="a")).status_code == 200
        assert (await client.get("/test/stored/r1")).json()["body"] == "a"
    store.close()
