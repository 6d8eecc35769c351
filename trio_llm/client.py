"""A Trio client for the WebSocket streaming protocol (``/v1/ws``, see docs/websocket.md).

Many generations share one connection; one reader task hands each event to the generation
it names::

    async with open_ws_client("ws://127.0.0.1:8000/v1/ws", api_key=key) as client:
        async with client.generate("chat", messages=messages, max_tokens=64) as generation:
            async for event in generation:
                if isinstance(event, DeltaEvent):
                    print(event.text, end="")

Leaving the ``async with client.generate(...)`` block before the generation's ``done``
cancels it on the server. A bare ``async for event in client.generate(...)`` works too,
but breaking out of that loop leaves the generation running until its end.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import trio
import trio_websocket

#: Largest message accepted from the server by default (bytes).
DEFAULT_MAX_MESSAGE_SIZE = 16 * 2**20

#: Events buffered per generation; when one generation's buffer is full, the reader waits
#: for it (and so does the connection: the server then holds further events back).
EVENT_BUFFER = 64

#: Seconds allowed for sending a ``cancel`` while the caller is being cancelled itself.
CANCEL_SEND_TIMEOUT = 5.0

#: Seconds allowed for the closing handshake when the client leaves.
CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True)
class DeltaEvent:
    """New output of one choice.

    Attributes:
        id: the generation's id.
        index: the choice's index (prompt index x ``n`` + sample).
        text: the new text.
        num_tokens: output tokens behind this delta (count).
        logprobs: in the HTTP streaming format of the request's endpoint, when asked for.
    """

    id: str
    index: int
    text: str
    num_tokens: int
    logprobs: dict[str, Any] | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The end of a generation (the last event it yields).

    Attributes:
        id: the generation's id.
        choices: ``{"index", "finish_reason", "stop_reason"}`` per choice; finish_reason
            is "stop", "length" or "abort" (cancelled).
        usage: ``prompt_tokens``, ``completion_tokens`` and ``total_tokens`` (counts).
    """

    id: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


class GenerationError(Exception):
    """The server ended a generation with an ``error`` event (it was refused or failed).

    Attributes:
        error: the OpenAI-style body: ``message``, ``type``, ``param``, ``code``.
    """

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "generation failed"))
        self.error = error

    @property
    def type(self) -> str | None:
        """The error's type, e.g. ``invalid_request_error``."""
        return self.error.get("type")

    @property
    def param(self) -> str | None:
        """The request field at fault, if any."""
        return self.error.get("param")

    @property
    def code(self) -> str | None:
        """A short machine-readable code, if any (e.g. ``too_many_generations``)."""
        return self.error.get("code")


class ConnectionClosedError(Exception):
    """The connection closed while a generation (or a caller) still waited for events.

    Attributes:
        code: the WebSocket close code (1006: dropped without a close frame).
        reason: the close reason sent by the server, if any.
    """

    def __init__(self, code: int, reason: str | None) -> None:
        super().__init__(f"the connection closed with code {code}: {reason or 'no reason'}")
        self.code = code
        self.reason = reason


class WSGeneration:
    """One generation on a `WSClient`: an async iterator of `DeltaEvent` then `DoneEvent`.

    The request is sent on entering ``async with`` or at the first iteration.

    Raises (from iteration):
        GenerationError: the server answered with an error event.
        ConnectionClosedError: the connection closed before the generation ended.
        ValueError: another generation with this id is running on the client.
    """

    def __init__(self, client: WSClient, kind: str, id: str, params: dict[str, Any]) -> None:
        self.client = client
        self.kind = kind
        self.id = id
        self.params = params
        #: Sent to the server, and ended (its ``done`` or an error arrived).
        self.started = self.finished = False
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](EVENT_BUFFER)

    async def start(self) -> None:
        """Send the request (once)."""
        if self.started:
            return
        self.started = True
        self.client._register(self)
        try:
            await self.client._send({"type": self.kind, "id": self.id, **self.params})
        except BaseException:
            self.finished = True
            self.client._generations.pop(self.id, None)
            raise

    async def cancel(self) -> None:
        """Ask the server to stop; the iteration then ends with a `DoneEvent` whose
        unfinished choices have finish_reason "abort". A no-op once the generation ended."""
        if not self.started:
            self.started = self.finished = True
            return
        if self.finished:
            return
        try:
            await self.client._send({"type": "cancel", "id": self.id})
        except ConnectionClosedError:
            pass  # the server has aborted everything of this connection already

    def __aiter__(self) -> WSGeneration:
        return self

    async def __anext__(self) -> DeltaEvent | DoneEvent:
        await self.start()
        while not self.finished:
            try:
                event = await self._receive.receive()
            except trio.EndOfChannel:
                self.finished = True
                raise self.client._closed_error() from None
            kind = event.get("type")
            if kind == "delta":
                return DeltaEvent(
                    id=event["id"],
                    index=event["index"],
                    text=event["text"],
                    num_tokens=event["num_tokens"],
                    logprobs=event.get("logprobs"),
                )
            if kind == "done":
                self.finished = True
                return DoneEvent(event["id"], event["choices"], event["usage"])
            if kind == "error":
                self.finished = True
                raise GenerationError(event.get("error") or {})
            # Another event type (a newer server): skip it.
        raise StopAsyncIteration

    async def __aenter__(self) -> WSGeneration:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self.finished:
            with trio.move_on_after(CANCEL_SEND_TIMEOUT, shield=True):
                await self.cancel()
            self.finished = True
        self._receive.close()  # later events of this id are dropped

    async def _deliver(self, event: dict[str, Any]) -> None:
        try:
            await self._send.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # nobody iterates any more

    def _end(self) -> None:
        self._send.close()


class WSClient:
    """A connection to ``/v1/ws`` (create it with `open_ws_client`)."""

    def __init__(self, websocket: trio_websocket.WebSocketConnection) -> None:
        self._websocket = websocket
        self._generations: dict[str, WSGeneration] = {}
        self._unclaimed_send, self._unclaimed = trio.open_memory_channel[Any](EVENT_BUFFER)
        self._close: tuple[int, str | None] | None = None  # code and reason, once closed

    def generate(
        self, kind: Literal["completion", "chat"], *, id: str | None = None, **params: Any
    ) -> WSGeneration:
        """A generation of ``kind`` with the fields of ``POST /v1/completions`` or
        ``POST /v1/chat/completions`` as ``params`` (``model``, ``prompt`` / ``messages``,
        ``max_tokens``, ...); ``id`` None picks a random one. Nothing is sent until it is
        entered or iterated."""
        return WSGeneration(self, kind, id if id is not None else uuid.uuid4().hex, params)

    async def send_raw(self, message: str | bytes) -> None:
        """Send one frame as is (text for str, binary for bytes); for tests.

        Raises:
            ConnectionClosedError: the connection is closed.
        """
        try:
            await self._websocket.send_message(message)
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed_error(exc) from None

    async def receive_unclaimed(self) -> Any:
        """The next event no generation of this client claimed: errors whose id is null
        and events for ids sent with `send_raw` (decoded JSON; a string if not JSON).

        Raises:
            ConnectionClosedError: the connection closed and nothing is left.
        """
        try:
            return await self._unclaimed.receive()
        except trio.EndOfChannel:
            raise self._closed_error() from None

    async def _send(self, message: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(message))

    def _register(self, generation: WSGeneration) -> None:
        if generation.id in self._generations:
            raise ValueError(f"a generation with id {generation.id!r} is already running")
        if self._close is not None:
            raise self._closed_error()
        self._generations[generation.id] = generation

    def _closed_error(
        self, exc: trio_websocket.ConnectionClosed | None = None
    ) -> ConnectionClosedError:
        """The error for a closed connection (the first close seen is remembered)."""
        if self._close is None:
            reason = exc.reason if exc is not None else self._websocket.closed
            if reason is None:
                return ConnectionClosedError(1006, None)
            self._close = (reason.code, reason.reason)
        return ConnectionClosedError(*self._close)

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await self._websocket.get_message()
                try:
                    event = json.loads(frame)
                except ValueError:
                    event = frame
                generation_id = event.get("id") if isinstance(event, dict) else None
                generation = None
                if isinstance(generation_id, str):
                    generation = self._generations.get(generation_id)
                if generation is None:
                    await self._unclaimed_send.send(event)
                    continue
                if event.get("type") in ("done", "error"):
                    del self._generations[generation.id]
                    await generation._deliver(event)
                    generation._end()
                else:
                    await generation._deliver(event)
        except trio_websocket.ConnectionClosed as exc:
            self._closed_error(exc)
        finally:
            for generation in self._generations.values():
                generation._end()
            self._unclaimed_send.close()


class _EndWatchingStream(trio.abc.Stream):
    """A stream that sets ``ended`` once the peer closed it (end-of-file or an error)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self.ended = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise
        if not data:
            self.ended.set()
        return data

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _connect(
    hostname: str, port: int | None, *, secure: bool
) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
    """A TCP connection (TLS with ``secure``) to ``hostname``, on its default port if None."""
    if secure:
        return await trio.open_ssl_over_tcp_stream(hostname, port or 443, https_compatible=True)
    return await trio.open_tcp_stream(hostname, port or 80)


async def _handshake(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    headers: list[tuple[bytes, bytes]] | None,
    max_message_size: int,
) -> trio_websocket.WebSocketConnection | None:
    """The opening handshake over ``stream`` (the connection's tasks run in ``nursery``);
    None when the server closed the connection before answering it."""
    watched = _EndWatchingStream(stream)
    # trio-websocket waits for the opening handshake forever if the server closes the
    # connection before answering it; the end of the stream ends that wait here.
    with trio.CancelScope() as handshake:
        async with trio.open_nursery() as watch:
            watch.start_soon(_cancel_when_set, watched.ended, handshake)
            websocket = await trio_websocket.wrap_client_stream(
                nursery,
                watched,
                host,
                resource,
                extra_headers=headers,
                max_message_size=max_message_size,
            )
            watch.cancel_scope.cancel()
    return None if handshake.cancelled_caught else websocket


@asynccontextmanager
async def open_ws_client(
    url: str,
    *,
    api_key: str | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> AsyncIterator[WSClient]:
    """Connect to ``url`` (``ws://HOST:PORT/v1/ws`` or ``wss://...``); yield a `WSClient`.

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>`` in the handshake.
        max_message_size: largest message accepted from the server (bytes); a larger one
            closes the connection with code 1009.

    Raises:
        ValueError: ``url`` is not a ``ws:`` or ``wss:`` URL.
        OSError: the server cannot be reached.
        trio_websocket.HandshakeError: the server refused the WebSocket handshake.
        ConnectionClosedError: the server closed the connection before answering the
            handshake (code 1006).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else None
    stream = await _connect(parts.hostname, parts.port, secure=parts.scheme == "wss")
    error: BaseException | None = None
    # The stream is ours to close: trio-websocket leaves it open when the server closes.
    async with stream, trio.open_nursery() as nursery:
        host = parts.netloc.rpartition("@")[2]
        websocket = await _handshake(
            nursery, stream, host, resource, headers=headers, max_message_size=max_message_size
        )
        if websocket is None:
            nursery.cancel_scope.cancel()
            error = ConnectionClosedError(
                1006, "the server closed the connection during the opening handshake"
            )
        else:
            client = WSClient(websocket)
            nursery.start_soon(client._read_loop)
            try:
                yield client
            except BaseException as exc:  # re-raised below, not wrapped in an ExceptionGroup
                error = exc
            finally:
                with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
                    await websocket.aclose()
                nursery.cancel_scope.cancel()
    if error is not None:
        raise error
