"""--max-num-waiting-requests: reservations are exact, and the excess gets a fast 503.

The engine is played by the test over an in-memory stream: it answers only when told, so
which requests are waiting is known exactly at every point.
"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from tests.unit.conftest import FakeEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.errors import EngineOverloadedError
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.messages import (
    SamplingParams,
)


async def _start(nursery: trio.Nursery) -> tuple[EngineClient, FakeEngine]:
    engine, stream = engine_client_pair()
    fake = FakeEngine(stream)
    nursery.start_soon(engine.route_outputs)
    nursery.start_soon(fake.run)
    return engine, fake


async def test_reservations_never_exceed_the_limit() -> None:
    async with trio.open_nursery() as nursery:
        engine, fake = await _start(nursery)
        first = engine.admit(2, limit=3)
        with pytest.raises(EngineOverloadedError):
            engine.admit(2, limit=3)
        assert engine.num_waiting == 2
        params = SamplingParams(max_tokens=5)
        async with engine.open_requests([([1], params), ([2], params)], first) as streams:
            await fake.wait_for_requests(2)
            assert engine.num_waiting == 2  # the reservation became two waiting requests
            engine.admit(1, limit=3)  # 3 of 3
            with pytest.raises(EngineOverloadedError):
                engine.admit(1, limit=3)
            await fake.output(streams[0].request_id)  # its first token: no longer waiting
            await streams[0].__anext__()
            assert engine.num_waiting == 2
        # Leaving the block aborted both in one message.
        with trio.fail_after(5):
            while len(fake.aborted) < 2:
                await fake.arrived.wait()
        assert sorted(fake.aborted) == sorted(s.request_id for s in streams)
        nursery.cancel_scope.cancel()


async def test_the_excess_gets_a_503_with_retry_after_and_the_rest_is_served(
    smol_tokenizer,
) -> None:
    async with trio.open_nursery() as nursery:
        engine, fake = await _start(nursery)
        serving = ModelServing(engine, smol_tokenizer, ("m",), max_num_waiting_requests=1)
        app = build_app(serving, lambda: True)
        transport = httpx.ASGITransport(app=app)
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            replies: list[httpx.Response] = []
            answered = trio.Event()

            async def first() -> None:
                replies.append(await client.post("/v1/completions", json=body))
                answered.set()

            nursery.start_soon(first)
            await fake.wait_for_requests(1)  # waiting in the engine, no output yet
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "too_many_waiting_requests"
            stream_body = {**body, "stream": True}
            refused_stream = await client.post("/v1/completions", json=stream_body)
            assert refused_stream.status_code == 503  # before any event is sent
            assert len(fake.added) == 1  # the refused ones never reached the engine

            await fake.output(fake.added[0], finish="length")
            with trio.fail_after(5):
                await answered.wait()
            assert replies[0].status_code == 200
            assert engine.num_waiting == 0
        nursery.cancel_scope.cancel()


async def test_more_choices_than_the_limit_is_a_400_not_a_503(smol_tokenizer) -> None:
    """A request that could never be admitted must not invite retries."""
    async with trio.open_nursery() as nursery:
        engine, fake = await _start(nursery)
        serving = ModelServing(engine, smol_tokenizer, ("m",), max_num_waiting_requests=2)
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "n"
        assert fake.added == []
        assert engine.num_waiting == 0
        nursery.cancel_scope.cancel()
