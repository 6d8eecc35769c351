"""The faults a chaos trial injects (`FAULTS`): signals to a process of the server's
tree (`fault_target` picks it), a client that never reads its stream, a burst past the
waiting limit (`tests.support.load.burst`), a hostile client (`HOSTILE_TRIGGERS`), clients
that leave right after sending a large request (`large_request_hangups`)."""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING, Any

import trio

from tests.support.load import MODEL, REQUEST_LIMIT, SECOND_MODEL
from tests.support.procfs import (
    command_line,
    detokenizer_children,
    engine_children,
)
from tests.support.server_process import ServerProcess
from tests.support.state_faults import STATE_FAULTS

if TYPE_CHECKING:
    from tests.support.chaos import TrialResult, TrialSpec


#: Every fault a trial can inject.
FAULTS = (
    "sigkill-server",
    "sigterm-server",
    "sigint-server",
    "sigkill-engine",
    "sigterm-engine",
    "sigint-engine",
    "sigkill-detokenizer",
    "sigterm-detokenizer",
    "sigint-detokenizer",
    "sigstop-engine",
    "stuck-client",
    "burst",
    "hostile-client",
    "large-request-hangup",
    # A batch running (tests.support.batch_chaos): kill -9 of the server, then a restart
    # on the same store; kill -9 of the engine child, restarted.
    "sigkill-server-batch",
    "sigkill-engine-batch",
    # A server of two models (issue 35): kill -9 of the second model's engine while the
    # load runs on both; the first model's requests are untouched.
    "sigkill-engine-two-models",
    # The server's state under hostile clients (issue 41, tests.support.state_faults): a
    # poisoned batch line, a flood of background responses, a conversation deleted under
    # a background response, slow and oversized chunked uploads.
    *STATE_FAULTS,
)

#: The faults whose server serves two models (`tests.support.load.SECOND_MODEL` too).
TWO_MODEL_FAULTS = ("sigkill-engine-two-models",)

#: What a "hostile-client" fault does (the trial's seed picks one; issue 14's triggers).
HOSTILE_TRIGGERS = (
    "ws-early-byte",  # a byte behind a WebSocket upgrade (killed the server once)
    "smuggling",  # Content-Length and Transfer-Encoding together
    "many-prompts",  # 1.5 M prompts in one 7.5 MB body
    "stop-strings",  # the most and longest stop strings allowed
    "surrogate",  # a lone surrogate in a stop string
    "hog",  # n = --max-num-seqs with a long output, never read
    "long-prompt",  # a prompt almost as long as the context
)


def open_stuck_request(port: int) -> socket.socket:
    """Connect to ``port`` and ask for a long stream that is never read (a small receive
    buffer, ``n=4`` with logprobs, so the server's writes soon block); the caller closes it.
    """
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        body = {"model": MODEL, "prompt": "Saga:", "max_tokens": 900, "ignore_eos": True}
        payload = json.dumps(body | {"logprobs": 5, "n": 4, "stream": True}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
    except BaseException:
        sock.close()
        raise
    return sock


async def stuck_client(port: int, opened: trio.Event, done: trio.Event) -> None:
    """A client that asks for a long stream and never reads it."""
    with open_stuck_request(port) as sock:
        await trio.lowlevel.wait_readable(sock)  # the stream has begun
        opened.set()
        await done.wait()


_UPGRADE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _http_request(path: str, body: dict[str, Any], extra_headers: bytes = b"") -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n".encode()
        + extra_headers
        + b"\r\n"
        + payload
    )


def hostile_request(trigger: str) -> tuple[bytes, tuple[bytes, ...]]:
    """The bytes a hostile client of ``trigger`` sends, and the status lines it may get
    (empty: the answer does not matter, only that the server is unharmed). A stream may
    also get a 503: a request with many choices can fill the waiting line on its own."""
    if trigger == "ws-early-byte":
        return _UPGRADE + b"X", ()
    refused = (b"HTTP/1.1 400",)
    streamed = (b"HTTP/1.1 200", b"HTTP/1.1 503")
    if trigger == "smuggling":
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        return head + b"0\r\n\r\n", refused
    if trigger == "many-prompts":
        return _http_request("/v1/completions", {"prompt": ["a"] * 1_500_000}), refused
    if trigger == "surrogate":
        return _http_request("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}), refused
    if trigger == "stop-strings":
        stops = [f"{i:03d}" + "z" * 253 for i in range(64)]
        body = {"prompt": "Story:", "max_tokens": 24, "stop": stops, "stream": True}
        return _http_request("/v1/completions", body), streamed
    if trigger == "hog":
        body = {"prompt": "Count:", "n": 16, "max_tokens": 900, "ignore_eos": True}
        return _http_request("/v1/completions", body | {"stream": True}), streamed
    if trigger == "long-prompt":
        body = {"prompt": list(range(1000, 2000)), "max_tokens": 4, "stream": True}
        return _http_request("/v1/completions", body), streamed
    raise ValueError(f"unknown hostile trigger {trigger!r}")


async def hostile_client(
    port: int, trigger: str, opened: trio.Event, done: trio.Event, result: TrialResult
) -> None:
    """Send one hostile request and check its status line; for a stream, wait for its
    first event (it has taken its place in the engine). Then hold the connection open
    without reading until ``done`` (a careless client)."""
    data, expected = hostile_request(trigger)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        async with stream:
            await stream.send_all(data)
            answer = b""
            with trio.move_on_after(REQUEST_LIMIT):
                while expected:
                    begun = answer.startswith(b"HTTP/1.1 200") and b"data: " in answer
                    if begun or (len(answer) >= 12 and not answer.startswith(b"HTTP/1.1 200")):
                        break
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    answer += chunk
            if expected and not answer.startswith(expected):
                result.failures.append(
                    f"hostile client {trigger}: got {answer[:80]!r}, expected one of {expected}"
                )
            opened.set()
            await done.wait()
    except OSError as exc:
        result.failures.append(f"hostile client {trigger}: {exc!r}")
        opened.set()


#: Requests a "large-request-hangup" fault sends; vocabulary of the chaos server's model.
HANGUPS = 3
VOCAB_SIZE = 49152


def large_request(path: str) -> bytes:
    """A request of about 0.7 MB that reaches the engine: a ``logit_bias`` over the whole
    vocabulary (as big as a frame to the engine can be from an allowed request)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8}
    body["logit_bias"] = {str(token): 1 for token in range(VOCAB_SIZE)}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    return _http_request(path, body)


async def large_request_hangups(port: int) -> None:
    """`HANGUPS` clients, one after another, each closing its connection as soon as its
    large request (`large_request`) is sent. Each of them once wedged the engine for
    good: the cancelled handler cut its frame to the engine in the middle (issue 30)."""
    for index in range(HANGUPS):
        path = ("/v1/completions", "/v1/chat/completions")[index % 2]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(large_request(path))


def fault_target(spec: TrialSpec, server: ServerProcess) -> int:
    if spec.fault.endswith("-server"):
        return server.pid
    if spec.fault in TWO_MODEL_FAULTS:  # the second model's engine (its command line says)
        tag = f"--served-model-name {SECOND_MODEL} "
        found = [p for p in engine_children(server.pid) if tag in command_line(p) + " "]
        if len(found) != 1:
            raise RuntimeError(f"expected the engine of {SECOND_MODEL}, found {found}")
        return found[0]
    found = (
        detokenizer_children(server.pid)
        if "detokenizer" in spec.fault
        else engine_children(server.pid)
    )
    if len(found) != spec.data_parallel_size:
        expected = spec.data_parallel_size
        raise RuntimeError(f"expected {expected} target processes for {spec.fault}, found {found}")
    return sorted(found)[spec.seed % len(found)]  # one engine's, under data parallelism
