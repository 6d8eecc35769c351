"""A request whose consumer stops reading is paused in the engine, and resumed when it reads.

The engine is played by the test over an in-memory stream (tests/unit/conftest.py's
FakeEngine), so the messages the client sends are seen exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.unit.conftest import FakeEngine, engine_client_pair
from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.frontend.engine_client import PAUSE_AFTER_UNREAD_TOKENS, EngineClient, RequestStream
from trio_llm.messages import (
    AddRequest,
    EngineReady,
    PauseRequests,
    ResumeRequests,
    SamplingParams,
)
from trio_llm.server_config import MAX_STREAM_INTERVAL, ServerConfig

INFO = EngineReady("/model", 4096, 64, 16, [2], 49152, "float32", 1)


@asynccontextmanager
async def _one_request(
    client: EngineClient, engine: FakeEngine, max_tokens: int
) -> AsyncIterator[RequestStream]:
    """One request for ``max_tokens`` open on ``client``, once ``engine`` has it; the
    block and all runs within 10 s."""
    params = SamplingParams(max_tokens=max_tokens)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.route_outputs)
            nursery.start_soon(engine.run)
            async with client.open_requests([([1], params)]) as (request,):
                await engine.wait_for(AddRequest)
                yield request
            nursery.cancel_scope.cancel()


async def test_unread_output_pauses_the_request_and_reading_resumes_it() -> None:
    client, stream = engine_client_pair(INFO)
    engine = FakeEngine(stream)
    params = SamplingParams(max_tokens=1000)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.route_outputs)
            nursery.start_soon(engine.run)
            async with client.open_requests([([1], params), ([2], params)]) as (slow, fast):
                added = [await engine.wait_for(AddRequest) for _ in range(2)]
                # The two choices of one API request share a group.
                assert added[0].group == added[1].group == slow.request_id
                # Just under the limit: nothing happens.
                await engine.tokens(slow.request_id, PAUSE_AFTER_UNREAD_TOKENS - 1)
                await engine.tokens(fast.request_id, 1)
                assert (await fast.__anext__()).token_ids == [28]
                assert not any(isinstance(m, PauseRequests) for m in engine.received)
                # One more unread token pauses it.
                await engine.tokens(slow.request_id, 1)
                paused = await engine.wait_for(PauseRequests)
                assert paused.request_ids == [slow.request_id]
                assert client.num_pauses == 1
                # Reading takes every token that arrived and resumes it.
                delta = await slow.__anext__()
                assert len(delta.token_ids) == PAUSE_AFTER_UNREAD_TOKENS
                resumed = await engine.wait_for(ResumeRequests)
                assert resumed.request_ids == [slow.request_id]
                # A reader that keeps up is never paused again.
                for _ in range(3):
                    await engine.tokens(slow.request_id, 10)
                    read = 0
                    while read < 10:
                        read += len((await slow.__anext__()).token_ids)
                assert client.num_pauses == 1
            nursery.cancel_scope.cancel()


async def test_stream_interval_gathers_tokens_after_the_first() -> None:
    """``--stream-interval 4``: the first token at once, then deltas of 4 tokens, and
    whatever is left when the request finishes; the engine's steps are unchanged."""
    client, stream = engine_client_pair(INFO)
    client.stream_interval = 4
    engine = FakeEngine(stream)
    deltas: list[tuple[int, str | None]] = []

    async def read(request: object) -> None:
        async for delta in request:  # type: ignore[attr-defined]
            deltas.append((len(delta.token_ids), delta.finish_reason))

    async with _one_request(client, engine, 100) as req:
        async with trio.open_nursery() as readers:
            readers.start_soon(read, req)
            await engine.tokens(req.request_id, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert deltas == [(1, None)]
            await engine.tokens(req.request_id, 3)
            await trio.testing.wait_all_tasks_blocked()
            assert deltas == [(1, None)]  # 3 of 4: held
            await engine.tokens(req.request_id, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert deltas == [(1, None), (4, None)]
            await engine.tokens(req.request_id, 2)
            await engine.output(req.request_id, finish="length")
            await trio.testing.wait_all_tasks_blocked()
            assert deltas == [(1, None), (4, None), (3, "length")]


async def test_a_reader_of_full_pieces_is_never_paused() -> None:
    """With the largest interval, a full piece of unread tokens does not pause the
    request (its reader is waiting for exactly that); 64 more than a full piece, less
    one, do, and the paused request's reader takes them all and resumes it."""
    client, stream = engine_client_pair(INFO)
    client.stream_interval = MAX_STREAM_INTERVAL
    engine = FakeEngine(stream)
    async with _one_request(client, engine, 1000) as req:
        await engine.tokens(req.request_id, 1)
        assert len((await req.__anext__()).token_ids) == 1
        for _ in range(3):
            await engine.tokens(req.request_id, MAX_STREAM_INTERVAL)
            assert len((await req.__anext__()).token_ids) == MAX_STREAM_INTERVAL
        assert client.num_pauses == 0
        unread = MAX_STREAM_INTERVAL - 1 + PAUSE_AFTER_UNREAD_TOKENS
        await engine.tokens(req.request_id, unread - 1)
        await trio.testing.wait_all_tasks_blocked()
        assert client.num_pauses == 0
        await engine.tokens(req.request_id, 1)
        await engine.wait_for(PauseRequests)
        assert len((await req.__anext__()).token_ids) == unread
        await engine.wait_for(ResumeRequests)


def test_stream_interval_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's flag: 1 by default, at most `MAX_STREAM_INTERVAL`; out of range is a
    usage error naming the flag; the config refuses it too (embedders build it)."""
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).stream_interval == 1
    args = parser.parse_args(["serve", "--stream-interval", "8"])
    assert config_from_args(args).stream_interval == 8
    for bad in ("0", "65", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--stream-interval", bad])
        assert "argument --stream-interval: not an integer from 1 to 64" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stream_interval must be between 1 and 64"):
        ServerConfig(stream_interval=65)
