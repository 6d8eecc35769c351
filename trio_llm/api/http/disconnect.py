"""Running a handler's work only while its client is still connected.

Under hypercorn a client that hangs up is reported as an ASGI ``http.disconnect`` message
(hypercorn reads the socket while the app runs and also turns a failed write into a
disconnect). The work runs in a nursery next to a task that waits for that message and
cancels the work, so the request's ``open_request`` block exits and aborts it in the
engine. Nothing here relies on the app noticing a failed write itself, though a write
error would cancel the work the same way, by propagating.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import trio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports that the client disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_while_connected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``work()``; cancel it and return None if the client disconnects first.

    An exception from ``work`` propagates as itself (not wrapped in an exception group).
    """
    result: list[T] = []
    error: list[Exception] = []

    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            await wait_for_disconnect(receive)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # Cancelled is a BaseException and passes through
            error.append(exc)
        nursery.cancel_scope.cancel()
    if error:
        raise error[0]
    return result[0] if result else None


class Emit(Protocol):
    """Sends one server-sent event: ``data``, named ``event`` when given."""

    def __call__(self, data: str, event: str | None = None) -> Awaitable[None]: ...


#: Characters that JSON leaves raw inside strings but that line splitters such as Python's
#: ``str.splitlines`` (and so ``httpx.Response.aiter_lines``) treat as line ends: NEL,
#: LINE SEPARATOR and PARAGRAPH SEPARATOR. A model can generate them.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(data: str, event: str | None = None) -> bytes:
    """One server-sent event, ``data: <data>\\n\\n``, in UTF-8; with ``event`` (the
    Anthropic and Responses streams name their events) an ``event: <event>`` line first.

    ``data`` is one line of JSON (or ``[DONE]``). NEL, U+2028 and U+2029 can only occur
    inside its strings, where the ``\\uXXXX`` escape means the same: escaping them keeps the
    JSON equal and the event on one line for clients that split lines more eagerly than
    the SSE format does.
    """
    line = f"data: {data.translate(_LINE_BREAKING)}\n\n"
    return (line if event is None else f"event: {event}\n{line}").encode()


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose events come from ``produce(emit)``.

    ``emit(data, event=None)`` sends one event (see `sse_event`). If the client
    disconnects, ``produce`` is cancelled (and whatever it holds open is closed by its own
    ``async with`` blocks).
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )

        async def emit(data: str, event: str | None = None) -> None:
            body = sse_event(data, event)
            await send({"type": "http.response.body", "body": body, "more_body": True})

        async def produce() -> bool:
            await self._produce(emit)
            return True

        if await run_while_connected(receive, produce):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
