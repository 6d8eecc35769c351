"""The access log: one line per HTTP request and per WebSocket connection, at ``info``
through the project's logging (`trio_llm.logging_setup`), once the response is over.

A line reads (as uvicorn's, with the duration and the request id added)::

    trio-llm: 127.0.0.1:50312 "POST /v1/chat/completions HTTP/1.1" 200 1.234s req_0a1b...

The path keeps its query string, as sent (percent-encoded); headers are never logged. A
streamed response is logged when its stream ends, so the duration is the whole stream's.
A client that hung up before the response was complete is said so (``client hung up``;
status 499 where no status was sent, as nginx and the ``http_requests_total`` metric
count it). A WebSocket connection is one line when it closes: ``101`` and its close code
once accepted, or the status of its refusal. Lines of a batch (``/v1/batches``,
``trio-llm run-batch``) run through the app in process and are not logged: the batch's
own requests are, and its output file holds each line's status. ``--disable-access-log``
turns the log off.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trio_llm.api.http.lanes import LANE_SCOPE_KEY

logger = logging.getLogger(__name__)

#: Characters of a logged path beyond this many are cut (an ``...`` marks the cut).
MAX_LOGGED_TARGET = 2048


def request_target(scope: Scope) -> str:
    """The request's path and query as the client sent them (``raw_path``; the path
    percent-encoded again where the server gave none), with control and other
    unprintable characters escaped so that a line of the log stays one line."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(scope.get("path", ""))
    query = scope.get("query_string", b"").decode("latin-1")
    target = f"{path}?{query}" if query else path
    target = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in target)
    if len(target) > MAX_LOGGED_TARGET:
        target = target[:MAX_LOGGED_TARGET] + "..."
    return target


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _request_id(scope: Scope) -> str:
    state = scope.get("state")
    return (state.get("request_id") if isinstance(state, dict) else None) or "-"


class _Exchange:
    """What one request's messages said: the status sent, whether the response (or the
    WebSocket connection) ended, whether the client left first."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.started = time.perf_counter()
        self.status: int | None = None
        self.complete = False
        self.hung_up = False
        self.close_code: int | None = None

    def sent(self, message: Message) -> None:
        kind = message["type"]
        if kind in ("http.response.start", "websocket.http.response.start"):
            self.status = message["status"]
        elif kind == "websocket.accept":
            self.status = 101
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.complete = not self.hung_up
        elif kind == "websocket.close":
            self.status = self.status or 403  # closed before accepting: the server's 403
            self.close_code = message.get("code", 1000)
            self.complete = True

    def received(self, message: Message) -> None:
        if message["type"] == "http.disconnect" and not self.complete:
            self.hung_up = True
        elif message["type"] == "websocket.disconnect" and not self.complete:
            self.close_code = message.get("code", 1005)
            self.complete = True

    def line(self, failed: BaseException | None) -> str:
        scope = self.scope
        version = scope.get("http_version", "1.1")
        kind = "WEBSOCKET" if scope["type"] == "websocket" else scope.get("method", "-")
        status = self.status
        note = ""
        if self.close_code is not None:
            note = f" (closed {self.close_code})"
        elif isinstance(failed, Exception):
            status, note = status or 500, " (failed)"
        elif failed is not None:
            note = " (cut short)"  # cancelled: the server stops
        elif not self.complete:
            status, note = status or 499, " (client hung up)"
        seconds = time.perf_counter() - self.started
        return (
            f'{_client(scope)} "{kind} {request_target(scope)} HTTP/{version}" '
            f"{status or '-'} {seconds:.3f}s {_request_id(scope)}{note}"
        )


class AccessLogMiddleware:
    """ASGI middleware writing the access log (see the module's docstring); outermost,
    so that the other middleware's refusals (401, 413) are logged too.

    Args:
        app: the ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, and log its line when the app is done with it."""
        if scope["type"] not in ("http", "websocket") or scope.get(LANE_SCOPE_KEY) == "batch":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope)

        async def watched_receive() -> Message:
            message = await receive()
            exchange.received(message)
            return message

        async def watched_send(message: Message) -> None:
            await send(message)
            exchange.sent(message)

        failed: BaseException | None = None
        try:
            await self.app(scope, watched_receive, watched_send)
        except BaseException as exc:
            failed = exc
            raise
        finally:
            logger.info(exchange.line(failed))
