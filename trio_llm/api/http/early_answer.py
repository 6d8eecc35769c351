"""A request answered before its body has all arrived: the rest of the body is the
app's no more (`AnsweredHTTPStream`, installed by `trio_llm.api.http.connection_guard`)."""

from __future__ import annotations

from contextlib import suppress
from typing import Any

import trio
from hypercorn.protocol.events import Body, EndBody, Request
from hypercorn.protocol.http_stream import HTTPStream


class AnsweredHTTPStream(HTTPStream):
    """Hypercorn's HTTP request stream, which stops handing the request's body to the app
    once the app has answered (its response is complete, or it returned).

    Hypercorn queues each piece of a request's body for the app (a queue of
    ``max_app_queue_size``), waiting for room when it is full, and on the connection's
    end queues ``http.disconnect`` the same way. An app that answers before reading the
    whole body (a 413 in the middle of an upload) leaves that queue full: the connection's
    reader waits on it for ever, so does the app's task when its finished response ends
    the stream, the connection is neither read nor closed, and the sending client hangs.
    Here, once answered, a piece waiting for room is dropped, later pieces too, and
    ``http.disconnect`` is queued only if there is room; the connection then closes as
    hypercorn decides (the request was not read to its end, so it closes).
    """

    _answered = False
    _waiting: set[trio.CancelScope]
    _queue: Any = None

    async def handle(self, event: Any) -> None:
        """Hypercorn's handling; body events after the answer are dropped."""
        if isinstance(event, Body | EndBody) and self._answered:
            return
        if not isinstance(event, Request):
            await super().handle(event)
            return
        self._waiting = set()
        await super().handle(event)
        put = getattr(self, "app_put", None)
        self._queue = getattr(put, "__self__", None)  # the app's trio.MemorySendChannel
        if self._queue is not None:
            self.app_put = self._put

    async def _put(self, message: Any) -> None:
        """Queue ``message`` for the app: waiting for room until the app answers, never
        after."""
        if self._answered:
            with suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self._queue.send_nowait(message)
            return
        with trio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                await self._queue.send(message)
            finally:
                self._waiting.discard(scope)

    def _stop_body(self) -> None:
        self._answered = True
        for scope in getattr(self, "_waiting", ()):
            scope.cancel()

    async def app_send(self, message: Any) -> None:
        """Hypercorn's handling of what the app sends; ``None``: the app returned."""
        if message is None:
            self._stop_body()
        await super().app_send(message)

    async def _send_closed(self) -> None:
        self._stop_body()
        await super()._send_closed()

    async def _send_error_response(self, status_code: int) -> None:
        self._stop_body()
        await super()._send_error_response(status_code)
