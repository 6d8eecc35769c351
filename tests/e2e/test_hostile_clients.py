"""Hostile and careless clients against a real server (issue 14).

Each test does what an attacker or a careless client does — protocol errors on raw
sockets, ambiguous framing, cross-site WebSocket pages, oversized or invalid requests, one
request asking for the whole batch, a client that never reads, a very long prompt — and
then checks that the server is the same process and still answers a normal request
normally. Speed is not asserted here (bench/fairness.py measures it); the order in which
things happen is.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import trio
from wsproto.events import CloseConnection, TextMessage

from tests.e2e.conftest import MODEL
from tests.e2e.test_websocket import _open_raw_websocket, ws_url
from tests.support.faults import large_request
from tests.support.metrics_scrape import metric, poll, wait_until_idle
from tests.support.server_process import ServerProcess

NORMAL = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}

UPGRADE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@pytest.fixture(scope="module")
def expected_answer(server: ServerProcess) -> str:
    """The normal request's greedy answer, before anything hostile happened."""
    response = httpx.post(f"{server.url}/v1/completions", json=NORMAL, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture
def same_server(server: ServerProcess, expected_answer: str) -> Iterator[ServerProcess]:
    """The shared server; afterwards it must be the same process, answering normally."""
    pid = server.pid
    yield server
    assert server.process is not None and server.process.poll() is None, server.log()
    assert server.pid == pid
    response = httpx.post(f"{server.url}/v1/completions", json=NORMAL, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_answer
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _exchange(server: ServerProcess, data: bytes, *, half_close: bool = False) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or the
    connection stays quiet for 2 s)."""
    with socket.create_connection(_address(server), timeout=2) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return received


def _masked_text_frame(text: str) -> bytes:
    payload = text.encode()
    assert len(payload) < 126
    mask = b"\x01\x02\x03\x04"
    body = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
    return bytes([0x81, 0x80 | len(payload)]) + mask + body


# ------------------------------------------------------------------ protocol errors

PROTOCOL_ABUSE = {
    # The reproducer: one byte right behind a WebSocket upgrade killed the server.
    "early byte after an upgrade": UPGRADE + b"X",
    "early bytes after an upgrade to a plain route": UPGRADE.replace(b"/v1/ws", b"/health")
    + b"\x00garbage",
    "a close frame before the handshake ends": UPGRADE + b"\x88\x80\x00\x00\x00\x00",
    "garbage after a request": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    + b"\x00\x01\x02 nonsense\r\n\r\n",
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
    "a bad request line": b"GARBAGE\r\n\r\n",
    "h2 with a bad preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64,
    "h2 preface then garbage frames": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00"
    + b"\xff\xff\xff\xff" * 16,
    "an h2c upgrade with trailing bytes": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: "
    b"Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
    + b"\xff"
    * 32,
    "a header with a NUL byte": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Evil: a\x00b\r\n\r\n",
    "a truncated chunked body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    b'Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nffff\r\n{"pro',
}


@pytest.mark.parametrize("data", PROTOCOL_ABUSE.values(), ids=PROTOCOL_ABUSE.keys())
def test_a_protocol_error_ends_only_its_connection(same_server: ServerProcess, data: bytes) -> None:
    _exchange(same_server, data)


@pytest.mark.parametrize("data", [UPGRADE + b"X", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_a_half_closed_socket_ends_only_its_connection(
    same_server: ServerProcess, data: bytes
) -> None:
    _exchange(same_server, data, half_close=True)


def test_a_websocket_frame_sent_with_the_upgrade_is_served(same_server: ServerProcess) -> None:
    """A client that writes its first frame right behind the upgrade request (RFC 6455 says
    to wait for the handshake response) gets its generation, not an error."""
    message = json.dumps(
        {"type": "completion", "id": "a", "model": MODEL, "prompt": "Hi", "max_tokens": 2}
    )
    with socket.create_connection(_address(same_server), timeout=30) as sock:
        sock.sendall(UPGRADE + _masked_text_frame(message))
        received = b""
        while b'"type": "done"' not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 101")
    assert b'"completion_tokens": 2' in received


async def test_protocol_errors_do_not_disturb_a_stream_in_flight(
    same_server: ServerProcess,
) -> None:
    """A stream that runs while every abuse above hits the server ends normally."""
    body = {**NORMAL, "max_tokens": 48, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=same_server.url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the stream is running
            for data in PROTOCOL_ABUSE.values():
                await trio.to_thread.run_sync(_exchange, same_server, data)
            events = [line async for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length"


# ------------------------------------------------------------------ framing and origins


@pytest.mark.parametrize("pipelined", [False, True])
def test_content_length_with_transfer_encoding_is_refused_and_closed(
    same_server: ServerProcess, pipelined: bool
) -> None:
    """RFC 9112 section 6.1: such a request may be smuggling; refuse it and close."""
    body = json.dumps(NORMAL).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    if pipelined:  # a second request on the same connection: it must never be answered
        request += b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    received = _exchange(same_server, request)
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), received
    assert b"connection: close" in head.lower()
    assert received.count(b"HTTP/1.1") == 1  # the connection was closed after the 400
    if not pipelined:
        # (With pipelined bytes behind it, hypercorn closes the connection from its
        # reading task as soon as the 400's head is written, so the body may not follow;
        # the status line always arrives.)
        assert json.loads(rest)["error"]["code"] == "ambiguous_request_framing"


@pytest.mark.parametrize(
    ("origin", "accepted"),
    [
        (None, True),  # not a browser
        ("SAME", True),  # the chat page served by this server
        ("http://evil.example", False),
        ("null", False),
        ("http://127.0.0.1:1", False),  # same host, another port: another origin
    ],
)
def test_without_allowed_origins_only_same_origin_pages_open_the_websocket(
    same_server: ServerProcess, origin: str | None, accepted: bool
) -> None:
    host = same_server.url.removeprefix("http://")
    headers = UPGRADE.replace(b"Host: x", f"Host: {host}".encode())
    if origin is not None:
        value = same_server.url if origin == "SAME" else origin
        headers = headers[:-2] + f"Origin: {value}\r\n\r\n".encode()
    with socket.create_connection(_address(same_server), timeout=10) as sock:
        sock.sendall(headers)
        status = sock.recv(65536).split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 101" if accepted else b"HTTP/1.1 403"), status


@pytest.mark.parametrize(
    "headers",
    [
        # DNS rebinding: a page of evil.example whose name now resolves to this machine.
        b"Host: evil.example\r\nOrigin: http://evil.example\r\n",
        b"Host: evil.example:80\r\nOrigin: http://evil.example\r\n",
        # Two origins, the first one harmless.
        b"Host: HOST\r\nOrigin: http://HOST\r\nOrigin: http://evil.example\r\n",
    ],
    ids=["rebound name", "rebound name with port", "two origins"],
)
def test_rebound_or_doubled_origins_cannot_open_the_websocket(
    same_server: ServerProcess, headers: bytes
) -> None:
    host = same_server.url.removeprefix("http://").encode()
    request = UPGRADE.replace(b"Host: x\r\n", headers.replace(b"HOST", host))
    with socket.create_connection(_address(same_server), timeout=10) as sock:
        sock.sendall(request)
        status = sock.recv(65536).split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 403"), status


def test_a_message_split_into_thousands_of_frames_is_refused_and_dropped(
    same_server: ServerProcess,
) -> None:
    """Each frame costs the event loop some microseconds whatever its size: a message of
    5,000 one-byte frames (past the 4,096 allowed) gets close code 1009, then the TCP
    connection is closed, and the frames after it are never parsed."""

    def frame(opcode: int, fin: bool, payload: bytes) -> bytes:
        return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + b"\0" * 4 + payload

    start = b'{"type": "completion", "id": "a", "prompt": "'
    frames = [frame(1, False, start)] + [frame(0, False, b"a")] * 5000
    frames.append(frame(0, True, b'", "max_tokens": 1}'))

    async def run() -> tuple[int | None, bool]:
        stream, connection = await _open_raw_websocket(ws_url(same_server.url))
        async with stream:
            try:
                await stream.send_all(b"".join(frames))
            except trio.BrokenResourceError:
                pass  # the server may close before it has read everything
            code = None
            with trio.fail_after(30):
                while True:
                    try:
                        data = await stream.receive_some()
                    except trio.BrokenResourceError:
                        data = b""
                    connection.receive_data(data or None)
                    for event in connection.events():
                        if isinstance(event, CloseConnection):
                            code = event.code
                    if not data:
                        return code, True

    code, closed = trio.run(run)
    assert closed
    assert code in (1009, 1006)  # 1006: the reset came before the close frame was read


def test_a_withheld_request_body_gets_408_and_the_connection_is_closed(
    same_server: ServerProcess,
) -> None:
    """Headers, then one byte of a 1,000-byte body, then silence: the shared server runs
    with --request-body-timeout 3, so the connection is not held for ever."""
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    with socket.create_connection(_address(same_server), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_client_that_leaves_mid_body_is_not_a_server_error(same_server: ServerProcess) -> None:
    before = same_server.log().count("Traceback")
    for _ in range(5):
        with socket.create_connection(_address(same_server), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
            )
    # The normal request of `same_server` runs after these: by then they were handled.
    response = httpx.post(f"{same_server.url}/v1/completions", json=NORMAL, timeout=60)
    assert response.status_code == 200
    assert same_server.log().count("Traceback") == before, same_server.log()[-3000:]


# ------------------------------------------------------------------ invalid requests


def _post_raw(server: ServerProcess, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )


OVERSIZED = {
    "1.5 M prompts": ("/v1/completions", {"prompt": ["a"] * 1_500_000, "max_tokens": 1}, "prompt"),
    "1.6 M token ids": ("/v1/completions", {"prompt": [1] * 1_600_000}, "prompt"),
    "a batch of over-long token prompts": (
        "/v1/completions",
        {"prompt": [[1] * 9000, [2] * 9000]},
        "prompt",
    ),
    "250 k chat messages": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}] * 250_000},
        "messages",
    ),
    "1,000 long stop strings": (
        "/v1/completions",
        {"prompt": "hi", "stop": ["ab" * 1000] * 1000},
        "stop",
    ),
    "one over-long stop string": ("/v1/completions", {"prompt": "hi", "stop": "x" * 300}, "stop"),
    "too many choices": ("/v1/completions", {"prompt": ["a", "b", "c"] * 100, "n": 8}, "n"),
}


@pytest.mark.parametrize(("path", "body", "param"), OVERSIZED.values(), ids=OVERSIZED.keys())
def test_an_oversized_request_is_refused_naming_the_field(
    same_server: ServerProcess, path: str, body: dict, param: str
) -> None:
    data = json.dumps({"model": MODEL, **body}, separators=(",", ":")).encode()
    assert len(data) < 8 * 1024**2  # under the body limit: the request's own limits answer
    response = _post_raw(same_server, path, data)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_an_oversized_websocket_generation_is_refused_naming_the_field(
    same_server: ServerProcess,
) -> None:
    async def run() -> dict:
        stream, connection = await _open_raw_websocket(ws_url(same_server.url))
        async with stream:
            message = {"type": "completion", "id": "big", "model": MODEL, "prompt": ["a"] * 5000}
            await stream.send_all(connection.send(TextMessage(json.dumps(message))))
            while True:
                connection.receive_data(await stream.receive_some())
                for event in connection.events():
                    if isinstance(event, TextMessage):
                        return json.loads(event.data)

    event = trio.run(run)
    assert event["type"] == "error" and event["id"] == "big"
    assert event["error"]["param"] == "prompt"


SURROGATES = {
    "stop": ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    "stop, streamed": (
        "/v1/completions",
        {"prompt": "hi", "stop": "a\udfff", "stream": True},
        "stop",
    ),
    "model": ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
    "user": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"},
        "user",
    ),
    "message name": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]},
        "messages",
    ),
}


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES.values(), ids=SURROGATES.keys())
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(
    same_server: ServerProcess, path: str, body: dict, param: str
) -> None:
    # Python's json writes a lone surrogate as the escape "\ud800", as a client could.
    response = _post_raw(same_server, path, json.dumps({"model": MODEL, **body}).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("value", [1e-300, 0.001, 2.5, 1e9])
def test_repetition_penalty_out_of_vllms_range_is_refused(
    same_server: ServerProcess, value: float
) -> None:
    body = {**NORMAL, "repetition_penalty": value, "temperature": 1}
    response = httpx.post(f"{same_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "repetition_penalty"


def test_a_small_repetition_penalty_gives_a_proper_distribution(same_server: ServerProcess) -> None:
    """At the smallest accepted penalty every reported logprob is a real probability."""
    body = {**NORMAL, "repetition_penalty": 0.01, "temperature": 1, "logprobs": 5, "max_tokens": 6}
    response = httpx.post(f"{same_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    for value, alternatives in zip(
        logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert -50 < value <= 0
        assert all(v <= 0 for v in alternatives.values())


# ------------------------------------------------------------------ clients that leave


def _leave_after_a_large_websocket_generation(server: ServerProcess) -> None:
    async def run() -> None:
        stream, connection = await _open_raw_websocket(ws_url(server.url))
        async with stream:
            body = json.loads(large_request("/v1/completions").partition(b"\r\n\r\n")[2])
            message = {"type": "completion", "id": "big", **body}
            await stream.send_all(connection.send(TextMessage(json.dumps(message))))

    trio.run(run)


def test_clients_that_leave_right_after_a_large_request_harm_nothing(
    same_server: ServerProcess, expected_answer: str
) -> None:
    # Issue 30: a client closing its socket right after a 0.7 MB request (a logit_bias
    # over the whole vocabulary) cut the frame to the engine in the middle; every later
    # request hung while /health said 200, and the third one made the engine exit.
    for index in range(6):
        if index % 3 == 2:
            _leave_after_a_large_websocket_generation(same_server)
        else:
            path = ("/v1/completions", "/v1/chat/completions")[index % 3]
            with socket.create_connection(_address(same_server)) as sock:
                sock.sendall(large_request(path))
        response = httpx.post(f"{same_server.url}/v1/completions", json=NORMAL, timeout=30)
        assert response.status_code == 200, (index, response.text)
        assert response.json()["choices"][0]["text"] == expected_answer
        assert httpx.get(f"{same_server.url}/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ fair share of the engine


async def test_a_request_with_many_choices_does_not_starve_a_newcomer(
    same_server: ServerProcess,
) -> None:
    """One request with n equal to --max-num-seqs (32 here) fills the batch for minutes; a
    short request sent after it still finishes while it runs."""
    hog = {
        "model": MODEL,
        "prompt": "Count:",
        "n": 32,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=same_server.url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=hog) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            seen: set[int] = set()
            while len(seen) < 32:  # every choice is generating: the batch is full
                line = await anext(lines)
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
            short = await client.post("/v1/completions", json={**NORMAL, "max_tokens": 3})
            assert short.status_code == 200
            assert short.json()["choices"][0]["finish_reason"] == "length"
            # The hog is still running (it is far from 4,000 tokens): the newcomer did not
            # wait for it.
            line = ""
            while not line:  # (blank lines separate events)
                line = await anext(lines)
            assert line.startswith("data: {"), line
        await wait_until_idle(client)


async def test_a_websocket_client_that_never_reads_is_paused_not_batched(
    same_server: ServerProcess,
) -> None:
    """Its generations are paused in the engine (no batch slot, no KV block) once their
    buffers fill, others run, and closing the connection aborts them."""
    async with httpx.AsyncClient(base_url=same_server.url, timeout=60) as monitor:
        await wait_until_idle(monitor)
        pauses = await metric(monitor, "request_pauses_total")
        stream, connection = await _open_raw_websocket(ws_url(same_server.url), 4096)
        async with stream:
            for i in range(4):
                body = {"type": "completion", "id": f"g{i}", "model": MODEL, "prompt": "Hi"}
                body |= {"max_tokens": 3000, "ignore_eos": True, "logprobs": 5}
                await stream.send_all(connection.send(TextMessage(json.dumps(body))))

            async def paused() -> bool:
                return await metric(monitor, "num_requests_paused") >= 1

            await poll(paused, 120)
            assert await metric(monitor, "request_pauses_total") > pauses
            response = await monitor.post("/v1/completions", json=NORMAL)
            assert response.status_code == 200
        await wait_until_idle(monitor)

        async def none_paused() -> bool:
            return await metric(monitor, "num_requests_paused") == 0

        await poll(none_paused)


class _TokenCount:
    """Tokens a stream received so far; `reached` waits for a count without polling."""

    def __init__(self) -> None:
        self.value = 0
        self._changed = trio.Event()

    def add(self) -> None:
        self.value += 1
        self._changed.set()
        self._changed = trio.Event()

    async def reached(self, value: int) -> None:
        while self.value < value:
            await self._changed.wait()


async def test_running_streams_keep_flowing_while_a_long_prompt_prefills(
    same_server: ServerProcess,
) -> None:
    """A 1,500-token prompt is prefilled in chunks of --long-prefill-token-threshold (128 on
    the CPU), so a running stream gets a token per chunk, and a short request sent after
    the long one gets its answer before the long one's first token."""
    long_body = {"model": MODEL, "prompt": list(range(1000, 2500)), "max_tokens": 1}
    running = {**NORMAL, "max_tokens": 400, "ignore_eos": True, "stream": True}
    tokens = _TokenCount()
    seen: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=same_server.url, timeout=300) as client:
        await wait_until_idle(client)

        async def run_stream(task_status: trio.TaskStatus[None]) -> None:
            async with client.stream("POST", "/v1/completions", json=running) as response:
                task_status.started()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        tokens.add()

        async def run_long() -> None:
            body = {**long_body, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and "long" not in seen:
                        seen["long"] = tokens.value

        async def run_short() -> None:
            response = await client.post("/v1/completions", json={**NORMAL, "max_tokens": 2})
            assert response.status_code == 200
            seen["short"] = tokens.value
            assert "long" not in seen, seen  # answered before the long prompt's first token

        async with trio.open_nursery() as nursery:
            await nursery.start(run_stream)
            await tokens.reached(2)
            start = tokens.value
            async with trio.open_nursery() as requests:
                requests.start_soon(run_long)
                await tokens.reached(start + 2)
                requests.start_soon(run_short)
            nursery.cancel_scope.cancel()
        # 1,500 tokens in chunks of 128: the running stream got a token per chunk.
        assert seen["long"] - start >= 8, (seen, start)
        await wait_until_idle(client)


def test_the_hostile_suite_left_no_paused_or_running_request(server: ServerProcess) -> None:
    async def check() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await wait_until_idle(client)
            assert await metric(client, "num_requests_paused") == 0

    trio.run(check)
    # Nothing a client did was logged as a server error (hypercorn's "Error in ASGI
    # Framework" with a traceback); protocol errors get one line each.
    assert "Error in ASGI Framework" not in server.log(), server.log()[-5000:]
