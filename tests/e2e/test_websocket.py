"""Token streaming over the WebSocket (``/v1/ws``) against a real server and model."""

from __future__ import annotations

import itertools
import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import jsonschema
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from tests.e2e.conftest import MODEL
from tests.support.metrics_scrape import metric, poll, wait_until_idle
from trio_llm import client as ws
from trio_llm.client import WSClient, open_ws_client

LONG = {"max_tokens": 2000, "ignore_eos": True}  # runs far longer than any test waits
CHAT = [{"role": "user", "content": "Name three colors."}]


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://") + "/v1/ws"


async def _open_raw_websocket(
    url: str, receive_buffer: int | None = None
) -> tuple[trio.SocketStream, WSConnection]:
    """A bare client connection (wsproto over TCP) that reads and sends only what the test
    says; ``receive_buffer`` shrinks the socket's receive buffer (bytes)."""
    address, _, target = url.removeprefix("ws://").partition("/")
    host, port = address.split(":")
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    connection = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(connection.send(Request(host=address, target="/" + target)))
    while True:
        connection.receive_data(await stream.receive_some())
        if any(isinstance(event, AcceptConnection) for event in connection.events()):
            return stream, connection


def _totals(usage: dict) -> dict:
    """``usage`` without ``prompt_tokens_details`` (the cached tokens differ between
    two requests for one prompt)."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


async def _run(client: WSClient, kind, **params):
    """Text, deltas and done of one generation."""
    *deltas, done = [event async for event in client.generate(kind, **{"model": MODEL, **params})]
    assert isinstance(done, ws.DoneEvent)
    return "".join(d.text for d in deltas), deltas, done


async def test_greedy_output_equals_the_http_answer(base_url: str) -> None:
    completion = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        expected_completion = (await http.post("/v1/completions", json=completion)).json()
        expected_chat = (await http.post("/v1/chat/completions", json=chat)).json()
    async with open_ws_client(ws_url(base_url)) as client:
        text, deltas, done = await _run(client, "completion", **completion)
        assert text == expected_completion["choices"][0]["text"]
        # Equal but for the prefix-cache hits (the HTTP request computed the prompt).
        assert _totals(done.usage) == _totals(expected_completion["usage"])
        assert (
            done.choices[0]["finish_reason"] == expected_completion["choices"][0]["finish_reason"]
        )
        assert sum(d.num_tokens for d in deltas) == done.usage["completion_tokens"]
        text, _, done = await _run(client, "chat", **chat)
        assert text == expected_chat["choices"][0]["message"]["content"]
        assert _totals(done.usage) == _totals(expected_chat["usage"])


async def test_generations_are_multiplexed_on_one_connection(base_url: str) -> None:
    async with open_ws_client(ws_url(base_url)) as client:
        for name in "abc":
            body = {"type": "completion", "id": name, "model": MODEL, "prompt": f"{name}:"}
            await client.send_raw(json.dumps({**body, "max_tokens": 6, "ignore_eos": True}))
        order: list[str] = []
        finished: set[str] = set()
        while len(finished) < 3:
            event = await client.receive_unclaimed()  # raw events, in the order sent
            assert event["id"] not in finished  # nothing comes after a generation's done
            order.append(event["id"])
            if event["type"] == "done":
                finished.add(event["id"])
                assert event["usage"]["completion_tokens"] == 6
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches > 2, order  # not one generation after the other


@asynccontextmanager
async def _idle_monitor(base_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, float]]:
    """A client for the metrics, once the server is idle, and its aborted requests then."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as monitor:
        await wait_until_idle(monitor)
        yield monitor, await metric(monitor, "request_aborted_total")


async def test_cancel_aborts_the_generation_at_once(base_url: str) -> None:
    async with _idle_monitor(base_url) as (monitor, aborted):
        async with open_ws_client(ws_url(base_url)) as client:
            generation = client.generate("completion", model=MODEL, prompt="Once", **LONG)
            async for event in generation:
                if isinstance(event, ws.DeltaEvent) and event.num_tokens:
                    await generation.cancel()
                    break
            *_, done = [event async for event in generation]
            assert isinstance(done, ws.DoneEvent)
            assert done.choices[0]["finish_reason"] == "abort"
            assert 0 < done.usage["completion_tokens"] < LONG["max_tokens"]
            # Its engine request was ended before the done went out.
            assert await metric(monitor, "request_aborted_total") == aborted + 1
            await wait_until_idle(monitor)
            _, _, again = await _run(client, "completion", prompt="Hi", max_tokens=3)
            assert again.choices[0]["finish_reason"] in ("stop", "length")


async def test_closing_the_socket_aborts_its_requests(base_url: str) -> None:
    async with _idle_monitor(base_url) as (monitor, aborted):
        async with open_ws_client(ws_url(base_url)) as client:
            one = client.generate("completion", model=MODEL, prompt="Once", **LONG)
            two = client.generate("chat", model=MODEL, messages=CHAT, n=2, **LONG)
            await one.__anext__()
            seen = set()
            while len(seen) < 2:  # both choices run
                seen.add((await two.__anext__()).index)

        async def all_aborted() -> bool:
            return await metric(monitor, "request_aborted_total") == aborted + 3

        await poll(all_aborted)
        await wait_until_idle(monitor)


async def test_invalid_messages_get_error_events_and_the_connection_stays(
    base_url: str,
) -> None:
    async with open_ws_client(ws_url(base_url)) as client:
        for raw, param in (
            ("not json", None),
            ("[1, 2]", None),
            (json.dumps({"type": "completion", "prompt": "Hi"}), "id"),
            (json.dumps({"type": "completion", "id": "", "prompt": "Hi"}), "id"),
            (json.dumps({"type": "cancel"}), "id"),
        ):
            await client.send_raw(raw)
            event = await client.receive_unclaimed()
            assert event["type"] == "error" and event["id"] is None, raw
            assert event["error"]["type"] == "invalid_request_error"
            assert event["error"]["param"] == param, raw
        await client.send_raw(json.dumps({"type": "bogus", "id": "u1"}))
        event = await client.receive_unclaimed()
        assert (event["id"], event["error"]["param"]) == ("u1", "type")

        for kind, params, param, code in (
            ("completion", {"prompt": "Hi", "temperature": -1}, "temperature", None),
            ("completion", {"prompt": "Hi", "echo": True}, "echo", None),
            ("chat", {"messages": []}, "messages", None),
            ("chat", {"messages": CHAT, "model": "nope"}, "model", "model_not_found"),
        ):
            with pytest.raises(ws.GenerationError) as refused:
                await _run(client, kind, **params)
            assert (refused.value.param, refused.value.code) == (param, code)
        assert refused.value.type == "not_found_error"

        _, _, done = await _run(client, "completion", prompt="Hi", max_tokens=2)
        assert done.usage["completion_tokens"] == 2


async def test_structured_output_fields_constrain_the_streamed_text(base_url: str) -> None:
    """The HTTP bodies' structured-output fields constrain what a ``chat`` message streams;
    a spec that cannot be enforced gets the HTTP 400's body as an ``error`` event naming the
    field (in ``completion`` messages too)."""
    schema = {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    }
    regex = r"#[0-9a-f]{6}"
    async with open_ws_client(ws_url(base_url)) as client:
        unenforceable = {"name": "u", "schema": {"type": "array", "uniqueItems": True}}
        message = {"type": "chat", "id": "bad", "model": MODEL, "messages": CHAT}
        message["response_format"] = {"type": "json_schema", "json_schema": unenforceable}
        await client.send_raw(json.dumps(message))
        event = await client.receive_unclaimed()
        assert (event["type"], event["id"]) == ("error", "bad")
        error = event["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "response_format")
        assert error["message"].startswith("response_format: ")
        assert "uniqueItems" in error["message"]
        with pytest.raises(ws.GenerationError) as refused:
            await _run(client, "completion", prompt="Hi", guided_regex="[a-z")
        assert refused.value.param == "guided_regex"

        # The connection stays; constrained generations stream valid text.
        response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
        params = {"messages": CHAT, "max_tokens": 60, "seed": 0}
        text, deltas, done = await _run(client, "chat", response_format=response_format, **params)
        assert done.choices[0]["finish_reason"] == "stop" and len(deltas) > 1
        jsonschema.validate(json.loads(text), schema)
        text, _, done = await _run(client, "chat", structured_outputs={"regex": regex}, **params)
        assert done.choices[0]["finish_reason"] == "stop" and re.fullmatch(regex, text), text


async def test_a_binary_frame_closes_with_1003(base_url: str) -> None:
    async with open_ws_client(ws_url(base_url)) as client:
        await client.send_raw(b"\x00\x01")
        with pytest.raises(ws.ConnectionClosedError) as closed:
            await client.receive_unclaimed()
    assert closed.value.code == 1003


async def test_logprobs_come_with_the_deltas(base_url: str) -> None:
    async with open_ws_client(ws_url(base_url)) as client:
        params = {"prompt": "Once upon", "max_tokens": 5, "ignore_eos": True, "logprobs": 2}
        _, deltas, _ = await _run(client, "completion", **params)
        tokens = [token for d in deltas for token in d.logprobs["tokens"]]
        assert len(tokens) == 5
        for delta in deltas:
            assert delta.logprobs is not None
            assert len(delta.logprobs["token_logprobs"]) == delta.num_tokens
            assert all(2 <= len(top) <= 3 for top in delta.logprobs["top_logprobs"])

        params = {"messages": CHAT, "max_tokens": 5, "ignore_eos": True}
        _, deltas, _ = await _run(client, "chat", logprobs=True, top_logprobs=2, **params)
        content = [entry for d in deltas if d.logprobs for entry in d.logprobs["content"]]
        assert len(content) == 5
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
        _, deltas, _ = await _run(client, "chat", **params)
        assert all(d.logprobs is None for d in deltas)


async def test_a_client_that_stops_reading_does_not_stall_others(base_url: str) -> None:
    """Its generations wait for it (bounded buffers); another connection's runs normally."""
    async with _idle_monitor(base_url) as (monitor, aborted):
        stream, connection = await _open_raw_websocket(ws_url(base_url), receive_buffer=4096)
        async with stream:
            # Big deltas (20 alternatives per token) fill the socket buffers quickly.
            params = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "logprobs": True}
            for i in range(3):
                body = {"type": "chat", "id": f"s{i}", "model": MODEL, "top_logprobs": 20}
                message = TextMessage(json.dumps({**body, **params}))
                await stream.send_all(connection.send(message))
            # ... and never reads a single event.
            async with open_ws_client(ws_url(base_url)) as other:
                _, _, done = await _run(other, "completion", prompt="Hi", max_tokens=8)
                assert done.usage["completion_tokens"] == 8
        # Closing the stuck connection (a reset: data was left unread) aborts its requests.

        async def all_aborted() -> bool:
            return await metric(monitor, "request_aborted_total") == aborted + 3

        await poll(all_aborted)
        await wait_until_idle(monitor)


async def test_invalid_utf8_drops_the_connection(base_url: str) -> None:
    """wsproto fails such a frame with 1007, but hypercorn then drops the TCP connection
    without sending that close frame: the client sees 1006 (abnormal closure)."""
    stream, connection = await _open_raw_websocket(ws_url(base_url))
    async with stream:
        # FIN + text opcode, masked with zeros, 2 bytes that are not UTF-8.
        await stream.send_all(bytes([0x81, 0x82, 0, 0, 0, 0, 0xFF, 0xFE]))
        while True:
            connection.receive_data(await stream.receive_some() or None)
            closes = [e for e in connection.events() if isinstance(e, CloseConnection)]
            if closes:
                break
    assert closes[0].code == 1006
