"""Hostile messages against a real server (issue 30): deeply nested JSON, a burst of
WebSocket generations, file descriptors run out, the ``x-api-key`` header on the WebSocket.

Each test checks the answer the client gets (a 400 naming the field, an error event per
refused generation) and what the server's log shows (no traceback), then that the server
still answers a normal request.
"""

from __future__ import annotations

import json
import resource
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from tests.e2e.conftest import GUARDED_API_KEY, MODEL
from tests.e2e.test_websocket import ws_url
from tests.support.metrics_scrape import poll
from tests.support.procfs import open_fds
from tests.support.server_process import ServerProcess
from trio_llm.client import ConnectionClosedError, DoneEvent, GenerationError, open_ws_client

NORMAL = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}

#: Far past Python's recursion limit (1,000) and every JSON parser's nesting limit.
VERY_DEEP = 5000
#: Past the server's limit (128 levels) but shallow enough for Python's json to parse.
DEEP = 400


def _deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _deep_text(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_body_text(prefix: str, depth: int, suffix: str) -> str:
    """JSON text with ``depth`` nested arrays between ``prefix`` and ``suffix`` (written
    out, since Python's json cannot write what it cannot read)."""
    return prefix + _deep_text(depth) + suffix


def _tool_history(arguments: str) -> list[dict[str, Any]]:
    """A chat history whose assistant turn called a tool with ``arguments``."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]


def _responses_history(arguments: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Call f."},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    ]


def _anthropic_history(tool_input: Any) -> list[dict[str, Any]]:
    use = {"type": "tool_use", "id": "call_1", "name": "f", "input": tool_input}
    result = {"type": "tool_result", "tool_use_id": "call_1", "content": "done"}
    return [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


CHAT = {"model": MODEL, "max_tokens": 2}
#: (path, body as JSON text, the field the 400 names). Today each of these is a 500
#: with a RecursionError traceback, or a 400 that names no field.
DEEP_REQUESTS = {
    "chat: tool-call arguments in the history": (
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": _tool_history(_deep_text(VERY_DEEP))}),
        "messages",
    ),
    "chat: tool-call arguments just past the limit": (
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": _tool_history(_deep_text(DEEP))}),
        "messages",
    ),
    "chat: a tool's parameters schema": (
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [_tool(_deep_schema(DEEP))],
                "tool_choice": "none",
            }
        ),
        "tools",
    ),
    "chat: a response_format schema given as text": (
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "messages": [{"role": "user", "content": "Hi"}],
                "structured_outputs": {"json": json.dumps(_deep_schema(DEEP))},
            }
        ),
        "structured_outputs",
    ),
    "chat: message content nested past what JSON parsing reaches": (
        "/v1/chat/completions",
        _deep_body_text(
            '{"model": "' + MODEL + '", "max_tokens": 2, "messages": [{"role": "user", "content": ',
            VERY_DEEP,
            "}]}",
        ),
        "messages",
    ),
    "completions: a prompt nested as lists": (
        "/v1/completions",
        json.dumps({**NORMAL, "prompt": _deep_list(DEEP)}),
        "prompt",
    ),
    "responses: function_call arguments in the input": (
        "/v1/responses",
        json.dumps(
            {
                "model": MODEL,
                "max_output_tokens": 16,
                "input": _responses_history(_deep_text(VERY_DEEP)),
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            }
        ),
        "input",
    ),
    "messages: a tool_use input in the history": (
        "/v1/messages",
        json.dumps(
            {
                **CHAT,
                "messages": _anthropic_history({"a": _deep_list(DEEP)}),
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            }
        ),
        None,  # Anthropic's error body has no field; the message names it
    ),
}


@pytest.fixture
def checked_server(server: ServerProcess) -> Iterator[ServerProcess]:
    """The shared server; afterwards its log has no traceback from the test, and it
    answers a normal request."""
    start = len(server.log())
    yield server
    response = httpx.post(f"{server.url}/v1/completions", json=NORMAL, timeout=60)
    assert response.status_code == 200, response.text
    new_lines = server.log()[start:]
    assert "Traceback" not in new_lines, new_lines
    assert "RecursionError" not in new_lines, new_lines


@pytest.mark.parametrize(
    ("path", "body", "param"), DEEP_REQUESTS.values(), ids=DEEP_REQUESTS.keys()
)
def test_deeply_nested_json_is_a_400_naming_the_field(
    checked_server: ServerProcess, path: str, body: str, param: str | None
) -> None:
    response = httpx.post(
        checked_server.url + path,
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    if path == "/v1/messages":
        error = response.json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert "messages" in error["error"]["message"]
        assert "nested" in error["error"]["message"]
    else:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert "nested" in error["message"] and "128" in error["message"]


async def test_deeply_nested_json_over_the_websocket_is_that_generations_error(
    checked_server: ServerProcess,
) -> None:
    async with open_ws_client(ws_url(checked_server.url)) as client:
        with pytest.raises(GenerationError) as refused:
            generation = client.generate(
                "chat", model=MODEL, messages=_tool_history(_deep_text(VERY_DEEP)), max_tokens=2
            )
            async for _ in generation:
                pass
        assert (refused.value.type, refused.value.param) == ("invalid_request_error", "messages")
        assert "nested" in str(refused.value)
        # Nested past what JSON parsing reaches: still that generation's error (its id
        # comes before the deep field).
        message = _deep_body_text(
            '{"type": "chat", "id": "deep", "max_tokens": 2, "messages": [{"role": "user", '
            '"content": ',
            VERY_DEEP,
            "}]}",
        )
        await client.send_raw(message)
        event = await client.receive_unclaimed()
        assert (event["type"], event["id"]) == ("error", "deep"), event
        assert event["error"]["param"] == "messages"
        # The connection serves on.
        *_, done = [e async for e in client.generate("completion", **NORMAL)]
        assert isinstance(done, DoneEvent) and done.usage["completion_tokens"] == 2


# ------------------------------------------------------------------ a burst of generations

NUM_BURST = 300
BURST_TOKENS = 8


async def test_a_burst_of_websocket_generations_gets_one_error_per_refused_one(
    checked_server: ServerProcess,
) -> None:
    """300 generations sent at once on one connection: those over the connection's limit
    of 64 are each refused with an error event, the others finish normally, and the
    connection stays open."""
    body = {"type": "completion", "model": MODEL, "prompt": "Once upon a time"}
    body |= {"max_tokens": BURST_TOKENS, "ignore_eos": True}
    async with open_ws_client(ws_url(checked_server.url)) as client:
        with trio.fail_after(300):
            for i in range(NUM_BURST):
                await client.send_raw(json.dumps({**body, "id": f"g{i}"}))
            ended: dict[str, dict[str, Any]] = {}
            while len(ended) < NUM_BURST:
                try:
                    event = await client.receive_unclaimed()
                except ConnectionClosedError as exc:
                    pytest.fail(f"closed after {len(ended)} generations ended: {exc}")
                if event["type"] in ("done", "error"):
                    assert event["id"] not in ended, event
                    ended[event["id"]] = event
            refused = [e for e in ended.values() if e["type"] == "error"]
            done = [e for e in ended.values() if e["type"] == "done"]
            assert {e["error"]["code"] for e in refused} <= {"too_many_generations"}
            assert len(done) >= 64, len(done)
            for event in done:
                assert event["choices"][0]["finish_reason"] == "length"
                assert event["usage"]["completion_tokens"] == BURST_TOKENS
            # The same connection serves a generation afterwards.
            *_, last = [e async for e in client.generate("completion", **NORMAL)]
            assert isinstance(last, DoneEvent) and last.usage["completion_tokens"] == 2


# ------------------------------------------------------------------ a server with --api-key

API_KEY = GUARDED_API_KEY


@pytest.fixture
def keyed(guarded_server: ServerProcess) -> ServerProcess:
    """The session's server started with ``--api-key`` (shared with test_operators)."""
    return guarded_server


async def _handshake(
    url: str, headers: list[tuple[bytes, bytes]]
) -> tuple[trio.SocketStream, WSConnection]:
    """A bare WebSocket connection to ``url``'s ``/v1/ws``, with ``headers``."""
    address = url.removeprefix("http://")
    host, port = address.rsplit(":", 1)
    connection = WSConnection(ConnectionType.CLIENT)
    request = connection.send(Request(host=address, target="/v1/ws", extra_headers=headers))
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        await stream.send_all(request)
        while True:
            connection.receive_data(await stream.receive_some())
            if any(isinstance(event, AcceptConnection) for event in connection.events()):
                return stream, connection
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


async def _next_event(stream: trio.SocketStream, connection: WSConnection) -> Any:
    """The next text message (decoded) or close frame of the connection."""
    while True:
        for event in connection.events():
            if isinstance(event, TextMessage):
                return json.loads(event.data)
            if isinstance(event, CloseConnection):
                return event
        data = await stream.receive_some()
        connection.receive_data(data or None)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x-api-key", API_KEY.encode())],
        [(b"authorization", b"Bearer " + API_KEY.encode())],
    ],
    ids=["x-api-key", "bearer"],
)
async def test_the_websocket_takes_the_key_as_every_v1_route_does(
    keyed: ServerProcess, headers: list[tuple[bytes, bytes]]
) -> None:
    message = {**NORMAL, "type": "completion", "id": "k"}
    with trio.fail_after(120):
        stream, connection = await _handshake(keyed.url, headers)
        async with stream:
            await stream.send_all(connection.send(TextMessage(data=json.dumps(message))))
            while True:
                event = await _next_event(stream, connection)
                assert not isinstance(event, CloseConnection), (event.code, event.reason)
                if event["type"] in ("done", "error"):
                    break
    assert event["type"] == "done", event
    assert event["usage"]["completion_tokens"] == 2
    # The HTTP routes take the same header.
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
        response = await http.post("/v1/completions", json=NORMAL, headers=dict(headers))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-api-key", b"sk-wrong")],
        [(b"x-api-key", API_KEY.encode() + b"x")],
        [(b"x-api-key", b"Bearer " + API_KEY.encode())],
    ],
    ids=["none", "wrong", "longer", "bearer-in-x-api-key"],
)
async def test_the_websocket_refuses_a_wrong_x_api_key_as_a_missing_one(
    keyed: ServerProcess, headers: list[tuple[bytes, bytes]]
) -> None:
    with trio.fail_after(60):
        stream, connection = await _handshake(keyed.url, headers)
        async with stream:
            event = await _next_event(stream, connection)
    assert isinstance(event, CloseConnection)
    assert (event.code, event.reason) == (1008, "invalid or missing API key")
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
        response = await http.post("/v1/completions", json=NORMAL, headers=dict(headers))
    assert response.status_code == 401


# ------------------------------------------------------------------ out of file descriptors

#: Connections opened beyond the descriptors the server has left.
NUM_EXTRA_CONNECTIONS = 60
#: How long the server is kept out of descriptors (seconds): the condition the test
#: creates, not a wait for something to happen.
EXHAUSTED_SECONDS = 3.0

_UPGRADE = (
    "GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    f"Authorization: Bearer {API_KEY}\r\n\r\n"
).encode()


def _accept_failure_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "EMFILE" in line or "Too many open" in line]


async def test_at_the_descriptor_limit_accept_errors_are_logged_once_a_second(
    keyed: ServerProcess,
) -> None:
    """With its descriptors used up by idle WebSockets, the server cannot accept: it says
    so at most once a second, without tracebacks, and serves again once they close."""
    host, port = keyed.url.removeprefix("http://").rsplit(":", 1)
    soft, hard = resource.prlimit(keyed.pid, resource.RLIMIT_NOFILE)
    spare = 40
    limit = len(open_fds(keyed.pid)) + spare
    start = len(keyed.log())
    sockets: list[socket.socket] = []
    resource.prlimit(keyed.pid, resource.RLIMIT_NOFILE, (limit, hard))
    try:
        try:
            for _ in range(spare + NUM_EXTRA_CONNECTIONS):
                sock = socket.create_connection((host, int(port)), timeout=30)
                sock.sendall(_UPGRADE)  # an idle WebSocket, once the server accepts it
                sockets.append(sock)

            async def refusing() -> bool:
                return bool(_accept_failure_lines(keyed.log()[start:]))

            await poll(refusing, 60)
            began = trio.current_time()
            await trio.sleep(EXHAUSTED_SECONDS)
            elapsed = trio.current_time() - began
            log = keyed.log()[start:]
        finally:
            for sock in sockets:
                sock.close()
        # Still at the low limit, it serves again once the idle connections are gone (the
        # ones waiting in the listen queue are accepted, found closed and dropped).
        async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as http:
            headers = {"x-api-key": API_KEY}
            response = await http.post("/v1/completions", json=NORMAL, headers=headers)
        assert response.status_code == 200, response.text
    finally:
        resource.prlimit(keyed.pid, resource.RLIMIT_NOFILE, (soft, hard))
    lines = _accept_failure_lines(log)
    assert 1 <= len(lines) <= elapsed + 2, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
