"""The routes that need no API key (issue 41, item 4 and "routes that need no key never
load, unload, pin or name anything on disk"): on a server with ``--api-key``,
``/tokenize`` and ``/detokenize`` stay open, as in vLLM, but a request without the key
changes nothing of the models; ``/health``, ``/metrics``, ``/version`` and the chat page
touch none either.

The app runs in-process over a `ModelPool` whose models are "loaded" by a fake starter
(`tests.unit.server.test_model_pool.FakeStarter`) as real `ModelServing`s over fake engine
handles (SmolLM2's tokenizer), on trio's autojump clock for ``keep_alive``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
import trio.testing

from tests.unit.conftest import INFO
from tests.unit.server.test_model_pool import FakeStarter, _config, _state, running_pool
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.model_router import peek_model
from trio_llm.errors import EngineDeadError
from trio_llm.server.model_pool import ModelPool
from trio_llm.server_config import ServerConfig, keep_alive_seconds
from trio_llm.text.tokenizer import Tokenizer

KEY = {"authorization": "Bearer sesame"}
#: Every open route that reads no body, and what it answers.
OPEN_GETS = {"/health": 200, "/metrics": 200, "/version": 200, "/": 200, "/static/chat.js": 200}


class ServingStarter(FakeStarter):
    """`FakeStarter` whose models serve: an `ModelServing` over a fake engine handle."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    async def __call__(self, config, owner, *, model_name, task_status):
        tokenizer = self.tokenizer

        class Status:
            def started(self, fake: Any) -> None:
                fake.engine.info = INFO
                task_status.started(ModelServing(fake.engine, tokenizer, config.model_names()))

        await super().__call__(config, owner, model_name=model_name, task_status=Status())


@asynccontextmanager
async def served(
    tokenizer: Tokenizer, **models: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, ModelPool, ServingStarter]]:
    """A client of the app (with ``--api-key sesame``) over a pool of the models "a"
    (the default) and "b", neither with a request in flight."""
    starter = ServingStarter(tokenizer)
    config = _config("a", "b", **models)
    async with running_pool(config, starter) as (pool, _nursery):
        app = build_app(pool, lambda: True, ServerConfig(api_key="sesame"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, pool, starter


async def test_tokenize_without_the_key_neither_unloads_nor_pins_nor_loads(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    async with served(smol_tokenizer, keep_alive=60.0) as (client, pool, starter):
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            for keep_alive in (0, -1, "5m"):
                refused = await client.post(path, json={**body, "keep_alive": keep_alive})
                assert refused.status_code == 401, refused.text
                error = refused.json()["error"]
                assert error["param"] == "keep_alive" and "API key" in error["message"]
            # A model not loaded is not loaded for it.
            refused = await client.post(path, json={**body, "model": "b"})
            assert refused.status_code == 503 and "not loaded" in refused.json()["error"]["message"]
            assert refused.json()["error"]["code"] == "model_unavailable"
        assert _state(pool, "a") == "loaded" and _state(pool, "b") == "unloaded"
        assert starter.starts == {"a": 1} and starter.stopped == []
        # The loaded model answers, and its idle time goes on: unloaded at 60 s all the
        # same (a request that counted as its use would keep it loaded for ever).
        await trio.sleep(59)
        answer = await client.post("/tokenize", json={"model": "a", "prompt": "Hi"})
        assert answer.status_code == 200 and answer.json()["count"] > 0
        answer = await client.post("/detokenize", json={"tokens": [28]})
        assert answer.status_code == 200
        await trio.sleep(2)
        assert _state(pool, "a") == "unloaded" and starter.stopped == ["a"]
        refused = await client.post("/tokenize", json={"prompt": "Hi"})
        assert refused.status_code == 503 and starter.starts == {"a": 1}


async def test_tokenize_with_the_key_manages_the_models_as_before(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    async with served(smol_tokenizer) as (client, pool, starter):
        answer = await client.post(
            "/tokenize", json={"model": "b", "prompt": "Hi", "keep_alive": 0}, headers=KEY
        )
        assert answer.status_code == 200
        assert starter.starts["b"] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert _state(pool, "b") == "unloaded"  # keep_alive 0: unloaded once answered


async def test_the_other_open_routes_touch_no_model(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    async with served(smol_tokenizer, keep_alive=60.0) as (client, pool, starter):
        await trio.sleep(59)
        for path, status in OPEN_GETS.items():
            assert (await client.get(path)).status_code == status, path
        for path in ("/models/load", "/models/unload"):  # these need the key
            refused = await client.post(path, json={"model": "b", "keep_alive": -1})
            assert refused.status_code == 401
        await trio.sleep(2)
        assert starter.starts == {"a": 1} and _state(pool, "a") == "unloaded"


#: Every route that reads ``keep_alive``, with a body it takes.
KEEP_ALIVE_BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/responses": {"input": "Hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1]},
    "/models/load": {"model": "b"},
}


async def test_a_keep_alive_past_a_doubles_range_is_a_400_naming_it(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    """Item 11: a JSON integer of 401 digits was a 500 (OverflowError) on every route;
    a negative one is "never unloaded", as any negative number (Ollama's)."""
    assert keep_alive_seconds(-(10**400)) is None
    async with served(smol_tokenizer) as (client, _pool, starter):
        assert await peek_model(b'{"keep_alive": -1' + b"0" * 400 + b"}") == (None, None)
        for path, body in KEEP_ALIVE_BODIES.items():
            text = json.dumps(body)[:-1] + ', "keep_alive": 1' + "0" * 400 + "}"
            headers = {**KEY, "content-type": "application/json"}
            answer = await client.post(path, content=text, headers=headers)
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]  # Anthropic's body (/v1/messages) has no param
            assert (
                error.get("param", "keep_alive") == "keep_alive"
                and "keep_alive" in error["message"]
            )
        assert starter.starts == {"a": 1}


async def test_a_model_that_fails_names_no_host_path_in_any_body(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Item 12: a model that failed to load named its file (``/.../zero.gguf is not a
    GGUF file``) in the 500 of its requests, in /v1/models and in the open /health.
    Bodies name it by its served name; the log keeps the paths."""
    zero = tmp_path / "zero.gguf"
    zero.write_bytes(b"")
    starter = ServingStarter(smol_tokenizer)
    starter.fail[str(zero)] = (
        f"{zero} is not a GGUF file (converted under /root/.cache/trio_llm/models/zero-1)"
    )
    config = _config("a", str(zero))
    async with running_pool(config, starter) as (pool, _nursery):
        app = build_app(pool, lambda: True, ServerConfig(api_key="sesame"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            failed = await client.post(
                "/v1/completions", json={"model": "zero", "prompt": "Hi"}, headers=KEY
            )
            assert failed.status_code == 500
            message = failed.json()["error"]["message"]
            assert message.startswith("the model `zero` failed to load: `zero` is not a GGUF")
            bodies = [
                failed.text,
                (await client.get("/health")).text,
                (await client.get("/v1/models", headers=KEY)).text,
            ]
            for body in bodies:
                assert "not a GGUF file" in body
                assert str(tmp_path) not in body and "/root/.cache" not in body, body


async def test_the_health_of_a_server_of_one_model_names_no_host_path(
    smol_tokenizer: Tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    async with served(smol_tokenizer) as (client, pool, _starter):
        pool.several = False
        engine = pool.statuses()[0].serving.engine
        engine.error = EngineDeadError("engine core died: /srv/models/a.gguf: read failed")
        engine.is_restarting = False
        engine.ended.set()
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "engine core died: <path>: read failed"
