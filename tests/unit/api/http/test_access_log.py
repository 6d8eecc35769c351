"""The access log (`trio_llm.api.http.access_log`): one line per request when its response is
over, streams and WebSockets included, and none of a batch's lines; sans I/O, around
small ASGI apps driven by hand."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from trio_llm.api.http.access_log import AccessLogMiddleware, request_target
from trio_llm.api.http.lanes import LANE_SCOPE_KEY
from trio_llm.api.http.middleware import RequestIdMiddleware

Message = dict[str, Any]


def _scope(path: str = "/v1/models", query: bytes = b"", **extra: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": [(b"authorization", b"Bearer sk-secret-key")],
        "client": ("10.1.2.3", 5555),
        "state": {},
        **extra,
    }


async def _answer(scope: dict, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def _call(app: Any, scope: dict, incoming: list[Message] | None = None) -> list[Message]:
    incoming = list(incoming or [{"type": "http.request", "body": b"", "more_body": False}])
    sent: list[Message] = []

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_llm.api.http.access_log"]


@pytest.fixture(autouse=True)
def _info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_llm.api.http.access_log")


async def test_a_line_has_client_method_path_query_status_duration_and_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = AccessLogMiddleware(RequestIdMiddleware(_answer))
    await _call(app, _scope("/v1/models", b"limit=2&after=x"))
    [line] = _lines(caplog)
    head, _, rest = line.partition(" 200 ")
    assert head == '10.1.2.3:5555 "GET /v1/models?limit=2&after=x HTTP/1.1"'
    seconds, request_id = rest.split()
    assert seconds.endswith("s") and float(seconds[:-1]) >= 0
    assert request_id.startswith("req_") and len(request_id) == 28
    assert "secret" not in caplog.text  # headers are never logged


async def test_a_refusal_inside_is_logged_with_its_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    await _call(AccessLogMiddleware(refuse), _scope())
    [line] = _lines(caplog)
    assert '"GET /v1/models HTTP/1.1" 401 ' in line and line.endswith(" -")


async def test_a_stream_is_logged_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    pieces: list[str] = []

    async def stream(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in ("a", "b", "c"):
            await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
            pieces.append(piece)
            assert _lines(caplog) == []  # nothing before the stream is over
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await _call(AccessLogMiddleware(stream), _scope())
    [line] = _lines(caplog)
    assert pieces == ["a", "b", "c"] and " 200 " in line and "hung up" not in line


async def test_a_client_that_hung_up_is_said_so(caplog: pytest.LogCaptureFixture) -> None:
    async def stream_until_gone(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass

    incoming = [{"type": "http.request", "body": b""}, {"type": "http.disconnect"}]
    await _call(AccessLogMiddleware(stream_until_gone), _scope(), incoming)
    assert _lines(caplog)[0].endswith(" (client hung up)")
    assert " 200 " in _lines(caplog)[0]

    async def wait_until_gone(scope: dict, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    await _call(AccessLogMiddleware(wait_until_gone), _scope(), incoming)
    assert " 499 " in _lines(caplog)[1] and _lines(caplog)[1].endswith(" (client hung up)")


async def test_an_app_failure_is_logged_as_500(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(scope: dict, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        await _call(AccessLogMiddleware(broken), _scope())
    [line] = _lines(caplog)
    assert " 500 " in line and line.endswith(" (failed)")


async def test_a_websocket_is_one_line_when_it_closes(caplog: pytest.LogCaptureFixture) -> None:
    async def echo_once(scope: dict, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hi"})
        await receive()

    scope = _scope("/v1/ws", type="websocket")
    incoming = [{"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1001}]
    await _call(AccessLogMiddleware(RequestIdMiddleware(echo_once)), scope, incoming)
    [line] = _lines(caplog)
    assert '"WEBSOCKET /v1/ws HTTP/1.1" 101 ' in line and line.endswith(" (closed 1001)")
    assert " req_" in line

    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.close", "code": 1008})

    await _call(AccessLogMiddleware(refuse), scope, incoming)
    assert " 403 " in _lines(caplog)[1] and _lines(caplog)[1].endswith(" (closed 1008)")


async def test_batch_lines_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    await _call(AccessLogMiddleware(_answer), _scope(**{LANE_SCOPE_KEY: "batch"}))
    assert _lines(caplog) == []


def test_a_path_cannot_break_a_log_line() -> None:
    scope = _scope("/v1/models\nfake line", b"q=\x1b[31m")
    scope["raw_path"] = None
    target = request_target(scope)
    assert "\n" not in target and "\x1b" not in target
    assert target == "/v1/models%0Afake%20line?q=\\x1b[31m"
    assert request_target(_scope("/" + "a" * 5000)).endswith("...")
