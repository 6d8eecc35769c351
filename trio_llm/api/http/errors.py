"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

The shape and the ``type`` values follow the OpenAI API reference (``invalid_request_error``
for 4xx caused by the request, ``server_error`` for 5xx).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trio_llm.api.http.routes import LISTED_ENDPOINTS, error_style
from trio_llm.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineRestartingError,
    EngineShutdownError,
    InvalidRequest,
    RequestRejectedError,
    first_leaf,
)
from trio_llm.store import Evicted, NotFound, StoreError, StoreUnavailable
from trio_llm.store.conversations import ConversationFull

logger = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) when the waiting line is full.
RETRY_AFTER_SECONDS = 1
#: The ``code`` of an append that would pass a conversation's limits.
CONVERSATION_TOO_LARGE = "conversation_too_large"


@dataclass(eq=False, repr=False)
class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI-style body (or Anthropic's, for a
    request to one of its routes: `body_for`).

    Attributes:
        status: HTTP status code.
        message: what went wrong, for a human.
        type: ``invalid_request_error``, ``not_found_error``, ``server_error``, ...
        param: the request field at fault, if one is.
        code: a short machine-readable code (e.g. ``model_not_found``), if any.
        headers: extra response headers (e.g. ``Retry-After`` on a 503).
        anthropic_message: the message in Anthropic's words where they differ (a
            context overflow, `trio_llm.errors.ContextLengthError`); None: ``message``.
    """

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None
    anthropic_message: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """The JSON body in Anthropic's shape (`anthropic_error_body`)."""
        return anthropic_error_body(self.status, self.anthropic_message or self.message)

    def body_for(self, path: str) -> dict[str, Any]:
        """The JSON body for a request to ``path``, in its route's error style
        (`trio_llm.api.http.routes.error_style`)."""
        return self.anthropic_body() if error_style(path) == "anthropic" else self.body()

    def response(self, path: str = "") -> JSONResponse:
        """The JSON response for a request to ``path`` (`body_for`)."""
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` as the OpenAI API returns it.

    A message that quotes the client's input could hold a lone surrogate, which no UTF-8
    response can carry; such characters are written as ``\\udXXX`` escapes instead.
    """
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


#: Anthropic's error ``type`` by HTTP status (its API reference, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` as Anthropic's API returns it
    (the error type follows from ``status``; other 4xx are invalid requests, 5xx
    ``api_error``)."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": kind, "message": message}}


#: A file system path in a message: ``/``, ``~/``, ``./`` or ``../`` that begins a word
#: (the text's start, or after a space, a quote, a bracket or ``=``; not a URL's ``//``),
#: up to a space, a quote, a bracket, a comma, a semicolon or a colon.
_HOST_PATH = re.compile(r"""(?<![^\s'"`(\[=])(?:~|\.{1,2})?/[^\s'"`()\[\],;:]*""")


def without_host_paths(text: str, known: Mapping[str, str] | None = None) -> str:
    """``text`` (an error's, for a response body) with no file system path in it: a path
    of ``known`` (or under one) shown as what it maps to (a model's path as its served
    name), any other path as ``<path>``. The server's log keeps the full text."""
    known = known or {}
    longest_first = sorted(known, key=len, reverse=True)

    def shown(match: re.Match[str]) -> str:
        path = match.group(0)
        for prefix in longest_first:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return known[prefix] + path[len(prefix) :]
        return "<path>"

    text = _HOST_PATH.sub(shown, text)
    for path in longest_first:  # a relative one the pattern does not see
        text = text.replace(path, known[path])
    return text


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param)


def unknown_model(name: str, served: list[str]) -> APIError:
    """The 404 for a ``model`` the server does not serve (``served``: the names it does)."""
    return APIError(
        404,
        f"the model `{name}` does not exist; this server serves {served}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def invalid_request(exc: InvalidRequest) -> APIError:
    """The 400 for a refusal of the request layer: its message, ``param`` and ``code``
    (``context_length_exceeded`` for a `ContextLengthError`, with Anthropic's words for
    the Messages API)."""
    anthropic = exc.anthropic_message if isinstance(exc, ContextLengthError) else None
    return APIError(400, exc.message, param=exc.param, code=exc.code, anthropic_message=anthropic)


#: How the engine's refusals of a request's output constraint begin (its compile failed
#: or timed out; its matcher failed during the output).
STRUCTURED_OUTPUT_ERRORS = ("structured_output: ", "structured output: ")


def engine_error(exc: EngineError, structured_param: str | None = None) -> APIError:
    """The HTTP error for an engine-side failure of one request; a refusal of its output
    constraint names ``structured_param`` (the request's field that gave it)."""
    if isinstance(exc, RequestRejectedError):
        message = str(exc)
        param = structured_param if message.startswith(STRUCTURED_OUTPUT_ERRORS) else None
        return bad_request(message, param)
    if isinstance(exc, EngineOverloadedError):
        return _retry_later(exc, "too_many_waiting_requests")
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), type="service_unavailable_error")
    if isinstance(exc, EngineRestartingError):
        return _retry_later(exc, "engine_restarting")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"engine core died: {exc}", type="server_error")
    return APIError(500, str(exc), type="server_error")


def _retry_later(exc: EngineError, code: str) -> APIError:
    """A 503 that asks the client to come back after ``Retry-After`` seconds."""
    return APIError(
        503,
        str(exc),
        type="service_unavailable_error",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def internal_message(exc: BaseException, during: str) -> str:
    """What a client is told of an unexpected error ``exc`` (a bug) while ``during``:
    the exception's type only, never its text (it may hold host paths or internals)."""
    return f"internal error while {during} ({type(first_leaf(exc)).__name__}); see the server log"


def internal_error(exc: BaseException, during: str) -> APIError:
    """The 500 of an unexpected error ``exc`` (a bug) while ``during`` one request, which
    it ends alone: its traceback goes to the log, `internal_message` to the client."""
    logger.error(f"internal error while {during}", exc_info=exc)
    return APIError(500, internal_message(exc, during), type="server_error")


def store_error(exc: StoreError) -> APIError:
    """The HTTP error for a failed store lookup or write: 400 naming the limit for an
    append that would pass a conversation's (`ConversationFull`), 404 for an id that is
    not (or no longer, `Evicted`) stored, 503 with ``Retry-After`` while the database is busy or
    unreachable, 507 when its disk is full, 500 otherwise."""
    if isinstance(exc, ConversationFull):
        return APIError(400, str(exc), param=exc.param, code=CONVERSATION_TOO_LARGE)
    if isinstance(exc, NotFound):
        code = "evicted" if isinstance(exc, Evicted) else "not_found"
        return APIError(404, str(exc), type="not_found_error", code=code)
    if isinstance(exc, StoreUnavailable):
        status = 507 if exc.full else 503
        headers = None if exc.full else {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(
            status, str(exc), type="server_error", code="store_unavailable", headers=headers
        )
    return APIError(500, str(exc), type="server_error", code="store_error")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The 400's message and the ``param`` it names, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # A field whose value fits none of a union's types gets one error per member; the
    # ones that say more than "wrong type" (a value out of range, invalid text) come first.
    first = next(
        (error for error in errors if not str(error.get("type", "")).endswith("_type")),
        errors[0],
    )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # The top-level field; deeper parts name union members ("str", "list[int]"), not fields.
    param = loc[0] if loc else None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app produces use the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StoreError)
    async def _store_error(request: Request, exc: StoreError) -> JSONResponse:
        return store_error(exc).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = (
                f"{where} is not an endpoint of this server; it serves "
                f"{', '.join(LISTED_ENDPOINTS)} (docs/api.md)"
            )
            error = APIError(404, message, type="not_found_error", code="unknown_url")
            return error.response(request.url.path)
        if exc.status_code == 405:
            message = f"{where}: the method {request.method} is not allowed on this endpoint"
            return APIError(405, message, headers=exc.headers).response(request.url.path)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this answer: the server logs the traceback.
        message = internal_message(exc, "answering the request")
        response = APIError(500, message, type="server_error").response(request.url.path)
        # Answered outside the middleware: the Anthropic request id is added here.
        request_id = getattr(request.state, "request_id", None)
        if request_id is not None and error_style(request.url.path) == "anthropic":
            response.headers["request-id"] = request_id
        return response
