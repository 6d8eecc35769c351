"""Reading a request's body off the connection, within ``--request-body-timeout``: the
one place the generating routes, the model routing (`trio_llm.api.model_router`) and
`ModelServing.parse` get the bytes from (starlette keeps them: a second read is free)."""

from __future__ import annotations

import trio
from fastapi import Request
from starlette.requests import ClientDisconnect

from trio_llm.api.http.errors import APIError
from trio_llm.api.http.middleware import RequestBodyTooLarge

#: HTTP status for a request whose client disconnected (nginx's convention; never seen).
CLIENT_CLOSED_REQUEST = 499


async def read_body(request: Request, within: float) -> bytes:
    """``request``'s whole body.

    Raises:
        APIError: 408 when it takes longer than ``within`` seconds to arrive (the
            connection is then closed); 413 past the body size limit; 499 when the client
            left mid-body.
    """
    try:
        with trio.fail_after(within):
            return await request.body()
    except trio.TooSlowError:
        raise APIError(
            408,
            f"the request body did not arrive within {within:g} s (--request-body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        # A client that leaves mid-body is no error of the server's: no traceback.
        raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request") from None
    except RequestBodyTooLarge as exc:
        # Answered by BodySizeLimitMiddleware with its 413; raised as an APIError so
        # that it is not logged as a server error on the way.
        raise APIError(413, str(exc), code="request_too_large") from None
