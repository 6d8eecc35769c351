"""The HTTP layer when the engine dies or its loop stops answering: in-flight requests get
errors, /health says 503.

The engine is played by the test over an in-memory stream, so the moment of death is
exact and nothing is timed.
"""

from __future__ import annotations

import json

import httpx
import trio
import trio.testing

from tests.unit.conftest import STATS, FakeEngine, engine_client_pair
from trio_llm import ipc
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.frontend.liveness import UNANSWERED_LIMIT
from trio_llm.messages import AddRequest, HealthReply, RequestOutput, StepOutputs


async def _fake_engine(stream: trio.abc.Stream, die_after_tokens: int) -> None:
    """Answer one request with a few tokens, then vanish like a killed process."""
    channel = ipc.engine_channel(stream)
    server_side = ipc.MessageChannel(channel.framed, object)
    message = await channel.receive()
    assert isinstance(message, AddRequest)
    for _ in range(die_after_tokens):
        await server_side.send(StepOutputs([RequestOutput(message.request_id, [28])], STATS))
    await stream.aclose()


async def _app_with_engine(nursery: trio.Nursery, smol_tokenizer, die_after_tokens: int):
    engine, stream = engine_client_pair()
    nursery.start_soon(engine.route_outputs)
    nursery.start_soon(_fake_engine, stream, die_after_tokens)
    serving = ModelServing(engine, smol_tokenizer, ("m",))
    return engine, build_app(serving, lambda: True)


async def test_a_non_streamed_request_gets_a_500_and_health_turns_503(smol_tokenizer) -> None:
    async with trio.open_nursery() as nursery:
        engine, app = await _app_with_engine(nursery, smol_tokenizer, die_after_tokens=2)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            body = {"model": "m", "prompt": "hello", "max_tokens": 50}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error"
            assert "engine core died" in error["message"]
            health = await client.get("/health")
            assert health.status_code == 503
            assert "exited unexpectedly" in health.json()["error"]["message"]
            # Later requests are refused at once, not queued.
            again = await client.post("/v1/completions", json=body)
            assert again.status_code == 500
        assert not engine.is_alive


async def test_a_stream_ends_with_an_error_event_then_done(smol_tokenizer) -> None:
    async with trio.open_nursery() as nursery:
        _, app = await _app_with_engine(nursery, smol_tokenizer, die_after_tokens=3)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": True}
            response = await client.post("/v1/completions", json=body)
    events = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine core died" in error["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts) == smol_tokenizer.decode([28, 28, 28])


async def test_health_turns_503_when_the_engine_loop_stops_answering(
    smol_tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    # Issue 30: an engine whose loop was stuck still sent heartbeats, and /health said 200.
    engine, stream = engine_client_pair()  # no step timeout: reported, not restarted
    fake = FakeEngine(stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        app = build_app(ModelServing(engine, smol_tokenizer, ("m",)), lambda: True)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await trio.sleep(10.0)
            assert (await client.get("/health")).status_code == 200
            fake.answers_health_checks = False
            await trio.sleep(UNANSWERED_LIMIT + 2.0)
            health = await client.get("/health")
            assert health.status_code == 503
            assert "left a health check unanswered" in health.json()["error"]["message"]
            fake.answers_health_checks = True
            await fake.server_side.send(HealthReply(fake.unanswered[-1].seq))
            await trio.testing.wait_all_tasks_blocked()
            assert (await client.get("/health")).status_code == 200
        nursery.cancel_scope.cancel()
