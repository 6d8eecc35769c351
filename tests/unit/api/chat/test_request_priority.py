"""vLLM's ``priority`` field and the batch lane through the HTTP app (issue 34).

The app runs in-process (httpx's ASGI transport) over a real `EngineClient`; the engine
core is played by the test (`ScriptedEngine`), which keeps every `AddRequest` it gets, so
what reaches the engine is read exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
import trio

from tests.unit.conftest import INFO, STATS, ScriptedEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.planner import Planner
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import APIError
from trio_llm.api.http.lanes import BATCH_LANE, LANE_SCOPE_KEY, lane_of
from trio_llm.async_engine import AsyncEngine
from trio_llm.frontend.generation_defaults import GenerationDefaults
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.messages import (
    AddRequest,
    EngineReady,
    RequestOutput,
    SamplingParams,
    Scheduling,
    StepOutputs,
)
from trio_llm.server_config import RequestLimits
from trio_llm.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "Hi"}]

#: One body per generating route, each asking for ``priority`` 7.
BODIES = {
    "/v1/completions": {"model": "m", "prompt": "Hello", "max_tokens": 2, "priority": 7},
    "/v1/chat/completions": {"model": "m", "messages": CHAT, "max_tokens": 2, "priority": 7},
    "/v1/responses": {"model": "m", "input": "Hi", "max_output_tokens": 2, "priority": 7},
}


class EmbeddingEngine(ScriptedEngine):
    """Answers every request with a 3-value vector."""

    async def on_message(self, message: object) -> None:
        if isinstance(message, AddRequest):
            done = RequestOutput(message.request_id, [], "stop", embedding=[1.0, 0.0, 0.0])
            await self.server_side.send(StepOutputs([done], STATS))


def _batch_lane(app):
    """``app`` as the in-process batch runner calls it: the lane in the ASGI scope."""

    async def call(scope, receive, send) -> None:
        await app({**scope, LANE_SCOPE_KEY: BATCH_LANE}, receive, send)

    return call


@asynccontextmanager
async def _served(
    tokenizer: Tokenizer, *, policy: str = "fcfs", task: str = "generate", batch: bool = False
) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    """A client of the app over a scripted engine of ``policy`` (and ``task``)."""
    info: EngineReady = msgspec.structs.replace(
        INFO, scheduling_policy=policy, task=task, embedding_dim=3 if task == "embed" else 0
    )
    engine, stream = engine_client_pair(info)
    fake = (EmbeddingEngine if task == "embed" else ScriptedEngine)(stream, [28])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        app = build_app(ModelServing(engine, tokenizer, ("m",)), lambda: True)
        transport = httpx.ASGITransport(app=_batch_lane(app) if batch else app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, fake
        nursery.cancel_scope.cancel()


def _added(fake: ScriptedEngine) -> list[AddRequest]:
    return [m for m in fake.received if isinstance(m, AddRequest)]


# ------------------------------------------------------------------ priority


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_fcfs_refuses_a_nonzero_priority_with_a_400_naming_it(
    smol_tokenizer: Tokenizer, path: str
) -> None:
    async with _served(smol_tokenizer) as (client, fake):
        response = await client.post(path, json=BODIES[path])
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "priority"
        assert "priority scheduling is not enabled" in error["message"]
        assert "--scheduling-policy" in error["message"]
        # Priority 0 (or null) is every request's: served under fcfs.
        for value in (0, None):
            ok = await client.post(path, json={**BODIES[path], "priority": value})
            assert ok.status_code == 200, ok.text
    assert all(m.scheduling == Scheduling() for m in _added(fake)) and len(_added(fake)) == 2


async def test_fcfs_refuses_a_priority_on_embeddings_too(smol_tokenizer: Tokenizer) -> None:
    body = {"model": "m", "input": ["a", "b"], "priority": -1}
    async with _served(smol_tokenizer, task="embed") as (client, fake):
        response = await client.post("/v1/embeddings", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "priority"
    assert _added(fake) == []


async def test_a_priority_reaches_every_engine_request_under_the_priority_policy(
    smol_tokenizer: Tokenizer,
) -> None:
    async with _served(smol_tokenizer, policy="priority") as (client, fake):
        for path, body in BODIES.items():
            response = await client.post(path, json={**body, "n": 2} if "prompt" in body else body)
            assert response.status_code == 200, response.text
        bad = await client.post(
            "/v1/completions", json={**BODIES["/v1/completions"], "priority": 1.5}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    added = _added(fake)
    assert len(added) == 4  # n=2 completion, chat, responses
    assert {m.scheduling for m in added} == {Scheduling(priority=7)}
    assert added[0].group == added[1].group is not None


async def test_the_planner_refuses_a_priority_under_fcfs(smol_tokenizer: Tokenizer) -> None:
    planner = Planner(
        inputs=InputPreprocessor(smol_tokenizer, 256, 49152),
        grammar_checks=trio.CapacityLimiter(1),
        limits=RequestLimits(),
        generation_defaults=GenerationDefaults(),
        max_logprobs=5,
        tool_call_parser=None,
        reasoning_parser=None,
        disable_additional_properties=True,
    )
    request = CompletionRequest.model_validate({"prompt": "Hello", "priority": 3})
    with pytest.raises(APIError) as refused:
        await planner.plan_completion(request, "m")
    assert refused.value.status == 400 and refused.value.param == "priority"
    planner.scheduling_policy = "priority"
    plan = await planner.plan_completion(request, "m")
    assert plan.scheduling == Scheduling(priority=3)
    chat = ChatCompletionRequest.model_validate({"messages": CHAT, "priority": -2})
    assert (await planner.plan_chat(chat, "m")).scheduling == Scheduling(priority=-2)


# ------------------------------------------------------------------ the batch lane


async def test_an_asgi_call_in_the_batch_lane_makes_batch_lane_engine_requests(
    smol_tokenizer: Tokenizer,
) -> None:
    async with _served(smol_tokenizer, policy="priority", batch=True) as (client, fake):
        completion = {**BODIES["/v1/completions"], "n": 3}
        assert (await client.post("/v1/completions", json=completion)).status_code == 200
        chat = {**BODIES["/v1/chat/completions"], "stream": True}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        responses = BODIES["/v1/responses"]
        assert (await client.post("/v1/responses", json=responses)).status_code == 200
    added = _added(fake)
    assert len(added) == 5
    assert {m.scheduling for m in added} == {Scheduling(priority=7, batch=True)}


async def test_embeddings_in_the_batch_lane(smol_tokenizer: Tokenizer) -> None:
    body = {"model": "m", "input": ["a", "b"]}
    async with _served(smol_tokenizer, task="embed", batch=True) as (client, fake):
        response = await client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
    assert [m.scheduling for m in _added(fake)] == [Scheduling(batch=True)] * 2


async def test_a_client_cannot_ask_for_the_batch_lane(smol_tokenizer: Tokenizer) -> None:
    async with _served(smol_tokenizer) as (client, fake):
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2, LANE_SCOPE_KEY: BATCH_LANE}
        headers = {LANE_SCOPE_KEY: BATCH_LANE}
        response = await client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200
    assert [m.scheduling for m in _added(fake)] == [Scheduling()]


def test_the_lane_of_a_scope() -> None:
    assert lane_of({"type": "http"}) == "interactive"
    assert lane_of({LANE_SCOPE_KEY: "batch"}) == "batch"
    with pytest.raises(ValueError, match=r"trio_llm\.lane"):
        lane_of({LANE_SCOPE_KEY: "urgent"})


# ------------------------------------------------------------------ the embedding API


async def test_the_embedding_api_takes_a_priority(smol_tokenizer: Tokenizer) -> None:
    for policy in ("fcfs", "priority"):
        info = msgspec.structs.replace(INFO, scheduling_policy=policy)
        client, stream = engine_client_pair(info)
        fake = ScriptedEngine(stream, [28])
        engine = AsyncEngine(client, smol_tokenizer)
        if policy == "fcfs":
            with pytest.raises(ValueError, match="priority scheduling is not enabled"):
                engine.generate("Hello", SamplingParams(max_tokens=2), priority=4)
            with pytest.raises(TypeError, match="priority"):
                engine.generate("Hello", priority=1.0)  # type: ignore[arg-type]
            continue
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.route_outputs)
            nursery.start_soon(fake.run)
            async with engine.generate("Hello", SamplingParams(max_tokens=2), priority=-4) as gen:
                async for _ in gen:
                    pass
            nursery.cancel_scope.cancel()
        assert [m.scheduling for m in _added(fake)] == [Scheduling(priority=-4)]
