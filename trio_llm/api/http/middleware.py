"""Operator-facing ASGI middleware: API keys, request body limits and CORS.

Each piece is plain ASGI (no ``BaseHTTPMiddleware``), so nothing here buffers a request or
a streamed response: the body limit counts bytes as hypercorn hands them over, and the
server-sent events of a streamed completion pass through untouched.

Order, outermost first: the framing check (a request that both ``Content-Length`` and
``Transfer-Encoding`` frame is refused before anything else reads it), CORS (so a browser
can read the 401 and 413 answers too, and a preflight never needs a key), then the API key
check (an unauthenticated client is refused before its body is read), then the body size
limit, then the FastAPI app.
"""

from __future__ import annotations

import hmac
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trio_llm.api.http.errors import APIError
from trio_llm.api.http.routes import OWN_BODY_LIMITS, error_style
from trio_llm.server_config import ServerConfig

#: Paths under these prefixes need the API key when one is configured: ``/v1`` (as in
#: vLLM) and ``/models/`` (loading and unloading models, llama.cpp's routes).
PROTECTED_PREFIXES = ("/v1", "/models/")

#: The ASGI scope key where `APIKeyMiddleware` records whether an HTTP request carried
#: the API key (True on a server without one): `key_presented`.
KEY_PRESENTED_SCOPE_KEY = "trio_llm.key_presented"


def key_presented(scope: Scope) -> bool:
    """Whether the request of ``scope`` carried the server's API key, or the server has
    none, as `APIKeyMiddleware` found; False for a request it did not see. Only such a
    request may change the server's models (`trio_llm.api.model_router`): the routes
    outside `PROTECTED_PREFIXES` (``/tokenize``...) are open to every client."""
    return scope.get(KEY_PRESENTED_SCOPE_KEY) is True


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send a complete JSON response with an OpenAI-style ``invalid_request_error`` body
    (Anthropic's error body for its routes: `trio_llm.api.http.routes.error_style`).

    Args:
        scope: the request's ASGI scope.
        send: the ASGI send callable (the response must not have started).
        status: HTTP status code.
        message: the human-readable ``error.message``.
        code: the machine-readable ``error.code``.
        extra_headers: more response headers (lower-case names, latin-1 bytes).
    """
    body = json.dumps(APIError(status, message, code=code).body_for(scope["path"])).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of the request header ``name`` (lower-case), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class _RequestCheck(ABC):
    """A middleware that looks at each HTTP request's head and either passes the request
    on or answers one fixed error: subclasses set `status`, `message`, `code` and
    `headers` and define `refused`.

    Args:
        app: the ASGI app behind the check.
    """

    status: int
    message: str
    code: str
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @abstractmethod
    def refused(self, scope: Scope) -> bool:
        """Whether the HTTP request with this scope gets the error."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, or answer the error with an OpenAI-style body."""
        if scope["type"] == "http" and self.refused(scope):
            await send_error(
                scope, send, self.status, self.message, code=self.code, extra_headers=self.headers
            )
            return
        await self.app(scope, receive, send)


class APIKeyMiddleware(_RequestCheck):
    """Refuse requests to ``/v1...`` and ``/models/...`` without ``Authorization: Bearer
    <api_key>`` or ``x-api-key: <api_key>`` (HTTP 401), and record in every HTTP
    request's scope whether it carried the key (`key_presented`).

    The key is compared in constant time. CORS preflight requests (``OPTIONS``) pass, as
    browsers send them without credentials; every other path is left open.

    Args:
        app: the ASGI app to protect.
        api_key: the key clients must present (visible ASCII); None: no key, every
            request passes (and may change the models).
    """

    status = 401
    message = (
        "the API key is missing or incorrect; send it as `Authorization: Bearer <key>` "
        "(or `x-api-key: <key>`)"
    )
    code = "invalid_api_key"
    headers = ((b"www-authenticate", b"Bearer"),)

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        super().__init__(app)
        self._key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Record whether the request carried the key, then check it."""
        if scope["type"] == "http":
            scope[KEY_PRESENTED_SCOPE_KEY] = self.authorized(scope)
        await super().__call__(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the right bearer token (the scheme is case-blind),
        or the key in ``x-api-key`` (the header Anthropic's clients send); True on a
        server without a key."""
        if self._key is None:
            return True
        anthropic_key = _header(scope, b"x-api-key")
        if anthropic_key is not None and hmac.compare_digest(anthropic_key.strip(), self._key):
            return True
        header = _header(scope, b"authorization")
        if header is None:
            return False
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self._key)

    def refused(self, scope: Scope) -> bool:
        """A request under ``/v1`` or ``/models/`` other than a preflight, without the key."""
        return (
            scope["path"].startswith(PROTECTED_PREFIXES)
            and scope["method"] != "OPTIONS"
            and not scope[KEY_PRESENTED_SCOPE_KEY]
        )


class RequestBodyTooLarge(Exception):
    """Raised from ``receive`` when the request body grows past the limit."""


class BodySizeLimitMiddleware:
    """Answer 413 to requests whose body is larger than ``max_bytes`` (except on the
    routes that limit their bodies themselves, `trio_llm.api.http.routes.OWN_BODY_LIMITS`).

    A ``Content-Length`` above the limit is refused before any of the body is read. A
    chunked body (or any other) is counted as it arrives: once it passes the limit,
    ``receive`` raises `RequestBodyTooLarge` inside the app and whatever response the app
    then tries to send is replaced by the 413. Both responses carry ``Connection: close``,
    since the rest of the body is never read.

    Args:
        app: the ASGI app.
        max_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def _refuse(self, scope: Scope, send: Send) -> None:
        await send_error(
            scope,
            send,
            413,
            self._message(),
            code="request_too_large",
            extra_headers=[(b"connection", b"close")],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on with a counting ``receive``, or answer 413."""
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OWN_BODY_LIMITS:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, send)
            return

        received = 0
        too_large = False
        response_started = False
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise RequestBodyTooLarge(self._message())
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started, refused
            if too_large and not response_started:
                # The app answers a body it could not read: send the 413 instead.
                if not refused:
                    refused = True
                    await self._refuse(scope, send)
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except RequestBodyTooLarge:
            if response_started:
                raise
        if too_large and not response_started and not refused:
            refused = True
            await self._refuse(scope, send)


class RequestFramingMiddleware(_RequestCheck):
    """Refuse requests whose body length is ambiguous (HTTP 400 and ``Connection: close``).

    A request carrying both ``Transfer-Encoding`` and ``Content-Length`` can be read two
    ways; a proxy in front that trusts the other header would see a different request
    boundary, so one client could smuggle a request into another's connection. RFC 9112
    section 6.1 lets a server reject such a request, and then requires it to close the
    connection; so does this middleware, before any other code reads the body.

    Args:
        app: the ASGI app.
    """

    status = 400
    message = "the request has both Content-Length and Transfer-Encoding; send one"
    code = "ambiguous_request_framing"
    headers = ((b"connection", b"close"),)

    def refused(self, scope: Scope) -> bool:
        """A request that has both headers."""
        names = {key.lower() for key, _ in scope.get("headers", ())}
        return b"transfer-encoding" in names and b"content-length" in names


def new_request_id() -> str:
    """A request id in the form of Anthropic's: ``req_`` and 24 hex digits."""
    return f"req_{uuid.uuid4().hex[:24]}"


class RequestIdMiddleware:
    """Give every HTTP request and WebSocket connection an id (`new_request_id`), left in
    the scope's ``state`` (``request.state.request_id``) for the access log
    (`trio_llm.api.http.access_log`) and the error handler of the outermost layer (an
    unexpected 500). Every response under ``/v1/messages`` (the Anthropic API) carries it
    in a ``request-id`` header, as Anthropic's API does: successes, streams and errors
    alike, the refusals of the middleware inside this one (401, 413) included.

    Args:
        app: the ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, with its id; on Anthropic routes, in its response's start."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        if scope["type"] != "http" or error_style(scope["path"]) != "anthropic":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Add the body size limit, the API key check (every request passes without
    ``config.api_key``, `key_presented`), CORS (if
    ``config.allowed_origins``), the framing check and the Anthropic ``request-id``
    header to ``app``, in that order from the inside out.

    Must be called before the app serves its first request.
    """
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    app.add_middleware(RequestFramingMiddleware)
    app.add_middleware(RequestIdMiddleware)
