"""The WebSocket endpoint and its Trio client, against an engine played by the test.

The app runs in-process under hypercorn on a free port; the engine core is a script over an
in-memory stream, so aborts, the engine's death and the server's shutdown happen at exact
moments and nothing is timed.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import hypercorn.trio
import pytest
import trio
import trio.testing

from tests.unit.conftest import STATS, FakeEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.websocket.handler import MAX_GENERATIONS_PER_CONNECTION
from trio_llm.client import (
    ConnectionClosedError,
    DeltaEvent,
    DoneEvent,
    GenerationError,
    WSClient,
    open_ws_client,
)
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    RequestOutput,
    StepOutputs,
)
from trio_llm.server.supervisor import _hypercorn_config
from trio_llm.server_config import ServerConfig

#: Requests with at most this many max_tokens finish; longer ones run until aborted.
SHORT = 8

#: Tokens a long request produces before it waits for its abort.
NUM_LONG_TOKENS = 2

#: A request with this max_tokens gets no output at all: it stays waiting in the queue.
QUEUED = 9


class ScriptedEngine(FakeEngine):
    """The engine core, scripted: a short request gets ``max_tokens`` tokens and finishes
    with "length"; a long one gets `NUM_LONG_TOKENS` tokens and then runs until aborted;
    one with `QUEUED` max_tokens waits. Every message from the server is also handed to
    the test (``messages``)."""

    def __init__(self, stream: trio.abc.Stream, token_ids: list[int]) -> None:
        super().__init__(stream)
        self.stream = stream
        self.token_ids = token_ids
        self._messages_send, self.messages = trio.open_memory_channel[object](math.inf)

    async def run(self) -> None:
        try:
            await super().run()
        except trio.ClosedResourceError:
            pass  # died

    async def on_message(self, message: object) -> None:
        self._messages_send.send_nowait(message)
        if isinstance(message, AddRequest):
            await self._answer(message)

    async def _answer(self, request: AddRequest) -> None:
        max_tokens = request.params.max_tokens
        if max_tokens == QUEUED:
            return
        count = max_tokens if max_tokens <= SHORT else NUM_LONG_TOKENS
        for i in range(count):
            token = self.token_ids[i % len(self.token_ids)]
            finish = "length" if i == count - 1 and count == max_tokens else None
            output = RequestOutput(request.request_id, [token], finish)
            await self.server_side.send(StepOutputs([output], STATS))

    async def next_of(self, kind: type) -> object:
        """The next message of type ``kind`` the server sent (earlier others are skipped)."""
        async for message in self.messages:
            if isinstance(message, kind):
                return message
        raise AssertionError("the server closed the engine channel")

    async def die(self) -> None:
        """Vanish like a killed process."""
        await self.stream.aclose()


@dataclass
class Server:
    url: str
    engine: EngineClient
    fake: ScriptedEngine


@asynccontextmanager
async def running_server(tokenizer, config: ServerConfig | None = None) -> AsyncIterator[Server]:
    config = config or ServerConfig(port=0)
    engine, stream = engine_client_pair()
    fake = ScriptedEngine(stream, tokenizer.encode(" one two three four", add_special_tokens=False))
    serving = ModelServing(
        engine, tokenizer, ("m",), max_num_waiting_requests=config.max_num_waiting_requests
    )
    app = build_app(serving, lambda: True, config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        serve = partial(hypercorn.trio.serve, app, _hypercorn_config(config))
        binds = await nursery.start(partial(serve, shutdown_trigger=stop.wait))
        yield Server(binds[0].replace("http://", "ws://") + "/v1/ws", engine, fake)
        stop.set()
        nursery.cancel_scope.cancel()


async def collect(client: WSClient, **params) -> list[DeltaEvent | DoneEvent]:
    params = {"model": "m", "prompt": "Hi", "max_tokens": 4, **params}
    return [event async for event in client.generate("completion", **params)]


async def test_a_completion_streams_deltas_then_done(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        events = await collect(client, id="a", max_tokens=4)
    *deltas, done = events
    assert all(isinstance(d, DeltaEvent) and d.id == "a" and d.index == 0 for d in deltas)
    expected = smol_tokenizer.decode(server.fake.token_ids[:4])
    assert "".join(d.text for d in deltas) == expected
    assert sum(d.num_tokens for d in deltas) == 4
    assert all(d.logprobs is None for d in deltas)
    assert isinstance(done, DoneEvent)
    assert done.choices == [{"index": 0, "finish_reason": "length", "stop_reason": None}]
    assert done.usage["completion_tokens"] == 4
    assert done.usage["total_tokens"] == done.usage["prompt_tokens"] + 4


async def test_generations_share_a_connection(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        results: dict[str, list] = {}

        async def run(name: str, max_tokens: int) -> None:
            results[name] = await collect(client, id=name, max_tokens=max_tokens)

        async with trio.open_nursery() as nursery:
            for i, name in enumerate(("x", "y", "z")):
                nursery.start_soon(run, name, 2 + i)
    for i, name in enumerate(("x", "y", "z")):
        assert {event.id for event in results[name]} == {name}
        assert results[name][-1].usage["completion_tokens"] == 2 + i


async def test_cancel_aborts_in_the_engine_and_ends_with_done(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        generation = client.generate("completion", id="long", model="m", prompt="Hi", max_tokens=50)
        first = await generation.__anext__()
        assert isinstance(first, DeltaEvent)
        added = await server.fake.next_of(AddRequest)
        await generation.cancel()
        abort = await server.fake.next_of(AbortRequests)
        assert abort.request_ids == [added.request_id]
        events = [event async for event in generation]
        assert isinstance(events[-1], DoneEvent)
        assert events[-1].choices[0]["finish_reason"] == "abort"
        await generation.cancel()  # after the end: nothing happens
        # A cancel for an id that never ran is answered with nothing at all: the next event
        # on the wire answers the message after it.
        await client.send_raw(json.dumps({"type": "cancel", "id": "nope"}))
        await client.send_raw("not json")
        assert (await client.receive_unclaimed())["error"]["message"].endswith("not valid JSON")


async def test_leaving_the_generation_block_cancels_it(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        async with client.generate("chat", messages=[{"role": "user", "content": "Hi"}]) as gen:
            async for _ in gen:
                break
        added = await server.fake.next_of(AddRequest)
        abort = await server.fake.next_of(AbortRequests)
        assert abort.request_ids == [added.request_id]
        # The connection still works.
        assert isinstance((await collect(client, max_tokens=2))[-1], DoneEvent)


async def test_closing_the_connection_aborts_everything_at_once(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server:
        async with open_ws_client(server.url) as client:
            generations = [
                client.generate("completion", model="m", prompt="Hi", n=2, max_tokens=50)
                for _ in range(3)
            ]
            for generation in generations:
                await generation.__anext__()
        ids = {(await server.fake.next_of(AddRequest)).request_id for _ in range(6)}
        aborted: set[str] = set()
        while aborted != ids:
            aborted |= set((await server.fake.next_of(AbortRequests)).request_ids)
        assert server.engine.num_in_flight == 0


async def test_the_per_connection_limit(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        running = []
        for i in range(MAX_GENERATIONS_PER_CONNECTION):
            generation = client.generate("completion", id=f"g{i}", model="m", prompt="Hi")
            running.append(generation)
            await generation.__anext__()  # started: its first delta arrived
        with pytest.raises(GenerationError) as refused:
            await collect(client, id="one-too-many")
        assert refused.value.code == "too_many_generations"
        await running[0].cancel()
        assert isinstance([e async for e in running[0]][-1], DoneEvent)
        assert isinstance((await collect(client, id="now-there-is-room"))[-1], DoneEvent)
        # A second generation with a running id is refused without naming that id.
        await client.send_raw(json.dumps({"type": "completion", "id": "g1", "prompt": "Hi"}))
        error = await client.receive_unclaimed()
        assert error["id"] is None and error["error"]["code"] == "duplicate_id"
        assert server.engine.num_in_flight == MAX_GENERATIONS_PER_CONNECTION - 1


async def test_a_full_waiting_line_is_an_error_event(smol_tokenizer) -> None:
    config = ServerConfig(port=0, max_num_waiting_requests=1)
    async with (
        running_server(smol_tokenizer, config) as server,
        open_ws_client(server.url) as client,
    ):
        waiting = client.generate("completion", model="m", prompt="Hi", max_tokens=QUEUED)
        await waiting.start()
        await server.fake.next_of(AddRequest)  # it is in the engine, waiting
        with pytest.raises(GenerationError) as refused:
            await collect(client)
        assert refused.value.type == "service_unavailable_error"
        assert refused.value.code == "too_many_waiting_requests"
        await waiting.cancel()
        assert [event async for event in waiting][-1].choices[0]["finish_reason"] == "abort"
        assert isinstance((await collect(client))[-1], DoneEvent)


async def test_engine_death_ends_generations_with_errors_then_closes_1011(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server, open_ws_client(server.url) as client:
        generations = [
            client.generate("completion", model="m", prompt="Hi", max_tokens=50) for _ in range(2)
        ]
        for generation in generations:
            await generation.__anext__()
        await server.fake.die()
        for generation in generations:
            with pytest.raises(GenerationError) as failed:
                async for _ in generation:
                    pass
            assert failed.value.type == "server_error"
            assert "engine core died" in str(failed.value)
        with pytest.raises(ConnectionClosedError) as closed:
            await client.receive_unclaimed()
        assert closed.value.code == 1011


async def test_shutdown_ends_generations_with_errors_then_closes_1001(smol_tokenizer) -> None:
    async with running_server(smol_tokenizer) as server:
        async with open_ws_client(server.url) as busy, open_ws_client(server.url) as idle:
            generation = busy.generate("completion", model="m", prompt="Hi", max_tokens=50)
            await generation.__anext__()
            await server.engine.stop(grace_period=1)
            with pytest.raises(GenerationError) as failed:
                async for _ in generation:
                    pass
            assert failed.value.type == "service_unavailable_error"
            for client in (busy, idle):
                with pytest.raises(ConnectionClosedError) as closed:
                    await client.receive_unclaimed()
                assert closed.value.code == 1001


async def test_an_oversized_message_closes_1009(smol_tokenizer) -> None:
    config = ServerConfig(port=0, max_request_body_bytes=1000)
    async with running_server(smol_tokenizer, config) as server:
        async with open_ws_client(server.url) as client:
            await client.send_raw(
                json.dumps({"type": "completion", "id": "a", "prompt": "x" * 999})
            )
            with pytest.raises(ConnectionClosedError) as closed:
                await client.receive_unclaimed()
        assert closed.value.code == 1009
        assert server.engine.num_in_flight == 0


async def test_the_api_key(smol_tokenizer) -> None:
    config = ServerConfig(port=0, api_key="sesame")
    async with running_server(smol_tokenizer, config) as server:
        for url, key in (
            (server.url, None),
            (server.url, "wrong"),
            (server.url + "?api_key=x", None),
        ):
            async with open_ws_client(url, api_key=key) as client:
                with pytest.raises(ConnectionClosedError) as closed:
                    await collect(client)
            assert (closed.value.code, closed.value.reason) == (1008, "invalid or missing API key")
        for url, key in ((server.url, "sesame"), (server.url + "?api_key=sesame", None)):
            async with open_ws_client(url, api_key=key) as client:
                assert isinstance((await collect(client))[-1], DoneEvent)


async def test_a_connection_closed_during_the_handshake_raises_at_once() -> None:
    """trio-websocket alone would wait for the handshake answer forever."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    async def close_after_the_request() -> None:
        connection, _ = await listener.accept()
        with connection:
            await connection.recv(4096)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_after_the_request)
        with trio.fail_after(10), pytest.raises(ConnectionClosedError, match="handshake") as info:
            async with open_ws_client(f"ws://127.0.0.1:{port}/v1/ws"):
                pass
    assert info.value.code == 1006
    listener.close()
