"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

The shape and the ``type`` values follow the OpenAI API reference (``invalid_request_error``
for 4xx caused by the request, ``server_error`` for 5xx).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trio_llm.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineRestartingError,
    EngineShutdownError,
    RequestRejectedError,
)

#: Seconds a client is told to wait (``Retry-After``) when the waiting line is full.
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI-style body.

    Args:
        status: HTTP status code.
        message: what went wrong, for a human.
        type: ``invalid_request_error``, ``not_found_error``, ``server_error``, ...
        param: the request field at fault, if one is.
        code: a short machine-readable code (e.g. ``model_not_found``), if any.
        headers: extra response headers (e.g. ``Retry-After`` on a 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` as the OpenAI API returns it.

    A message that quotes the client's input could hold a lone surrogate, which no UTF-8
    response can carry; such characters are written as ``\\udXXX`` escapes instead.
    """
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param)


def engine_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine-side failure of one request."""
    if isinstance(exc, RequestRejectedError):
        return bad_request(str(exc))
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
    message = first.get("msg", "invalid value")
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
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        return APIError(500, message, type="server_error").response()
