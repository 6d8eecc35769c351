"""One connection's failure ends that connection, never the server.

Hypercorn's Trio worker runs each accepted connection as ``TCPServer(...).run()`` in the
server's handler nursery. ``run`` only expects ``OSError``: any other exception from the
protocol stack (h11, h2, wsproto, or hypercorn's glue between them) propagates into that
nursery and ends ``hypercorn.trio.serve`` — and with it the whole server. One known
trigger: bytes that arrive in the same packet as a WebSocket upgrade request, before the
handshake is answered. Hypercorn answers 400, and then h11 raises ``LocalProtocolError``
("Can't send data when our state is ERROR") while ending that response (the family of
hypercorn issue #225).

`install` makes the worker build `GuardedTCPServer` instead: the same connection
handling, with every ``Exception`` from one connection caught at the connection's edge,
logged on one line, and the connection's socket closed. Cancellation (and anything else
that is not an ``Exception``) still propagates, so shutdown is unchanged.

It also fixes that known trigger at its source (`EarlyDataWSStream`): WebSocket bytes that
arrive before the handshake is answered wait until the app accepts, and are then read as
the connection's first frames, so a client that writes its first frame right behind the
upgrade request is served. And it refuses a WebSocket message split into more than
`MAX_FRAGMENTS` frames (close code 1009, then the connection is dropped).

A request answered before its body has all arrived (a 413 or 408 in the middle of an
upload) is not left half-open: the rest of its body is no longer queued for the app, which
no longer reads it (`trio_llm.api.http.early_answer.AnsweredHTTPStream`; hypercorn would block
on the app's full queue, and the client's send with it), and the connection is closed
after a bounded lingering drain (`GuardedTCPServer`), so the client sees the answer and
then the end of the connection.

HTTP/1.1 status lines get their reason phrase (`ReasonPhraseH11Protocol`):
hypercorn writes ``HTTP/1.1 404 \r\n``, and clients that print ``response.reason``
(vLLM's benchmark client, LiteLLM) then show a blank error.

Last, a server that cannot accept connections (out of file descriptors: EMFILE) says so
at most once a second, on one line (`AcceptErrorFilter`), instead of ten tracebacks a
second; it goes on retrying, and accepts again as soon as descriptors are free.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from math import inf
from typing import Any

import h11
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.trio.run
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import Body, Data, StreamClosed
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.protocol.ws_stream import (
    ASGIWebsocketState,
    FrameTooLargeError,
    WebsocketBuffer,
    WSStream,
)
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from wsproto.events import CloseConnection
from wsproto.frame_protocol import CloseReason

from trio_llm.api.http.early_answer import AnsweredHTTPStream
from trio_llm.errors import first_leaf

logger = logging.getLogger(__name__)

#: Connections ended by a protocol error since start-up (read by tests and logs).
num_connection_errors = 0

#: Lingering close: after the last response, unread request bytes are read and dropped
#: for up to this long (seconds) and this much (bytes) before the socket is closed.
LINGER_SECONDS = 2.0
LINGER_BYTES = 256 * 1024

#: Most frames one WebSocket message may be split into (a larger one is refused, 1009).
MAX_FRAGMENTS = 4096

#: Kernel send buffer of each client connection (bytes; Linux doubles it for bookkeeping).
SEND_BUFFER_BYTES = 64 * 1024

#: The logger of Trio's accept loop (``trio.serve_listeners``, which hypercorn runs).
ACCEPT_LOGGER = "trio.serve_listeners"

#: Shortest time between two log lines about failing accepts (seconds).
ACCEPT_ERROR_LOG_INTERVAL = 1.0


class GuardedTCPServer(TCPServer):
    """Hypercorn's per-connection handler with its failures contained (see module doc)."""

    async def run(self) -> None:
        """Serve the connection; an exception inside it closes only this connection."""
        global num_connection_errors
        _bound_send_buffer(self.stream)
        try:
            await super().run()
        except* Exception as group:
            num_connection_errors += 1
            first = first_leaf(group)
            logger.warning(
                "a client connection ended with a protocol error "
                f"({type(first).__name__}: {first}); the server goes on"
            )
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    _reading = False  # the reader task is in its loop (`_read_data`)
    _lingering = False  # the connection is closing: the reader drains, then closes
    _read_scope: trio.CancelScope | None = None

    async def _read_data(self) -> None:
        """Hypercorn's read loop, which also drains the connection when it closes while
        this task reads (see `_close`): what the client still sends is then read and
        dropped, bounded by `LINGER_SECONDS` and `LINGER_BYTES`, and the socket closed."""
        drained = 0
        self._reading = True
        try:
            with trio.CancelScope() as self._read_scope:
                while True:
                    try:
                        with trio.fail_after(self.config.read_timeout or inf):
                            data = await self.stream.receive_some(MAX_RECV)
                    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                        break
                    if self._lingering:
                        drained += len(data)
                        if not data or drained >= LINGER_BYTES:
                            break
                        continue
                    await self.protocol.handle(RawData(bytes(data)))
                    if not data:
                        break
        finally:
            self._reading = False
        if self._lingering:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
        await self.protocol.handle(Closed())

    async def _close(self) -> None:
        """Close after a *lingering* drain (RFC 9112 section 9.6).

        Closing a socket with unread bytes in its receive queue makes the kernel reset
        the connection, and a reset can destroy the response the client has not read
        yet: a 400 or 413 sent to a client that sent more than was read, or pipelined
        another request. So the write side is shut first, then what the client still
        sends is read and dropped (bounded in time and bytes) until it closes its side.
        A write in progress finishes first. When an HTTP/1.1 request is answered before
        its body has all arrived (the client may well be sending the rest), the
        connection's reader task, which owns the receiving side, does the draining and
        closes the socket; this only sets it a deadline.
        """
        deferred = False
        try:
            # Under the send lock: a response being written (by the app's task) is not
            # cut mid-write by this task's end-of-file (hypercorn closes from the reading
            # task when a client sends more after a "Connection: close" answer).
            if self.send_lock.statistics().owner is trio.lowlevel.current_task():
                await self.stream.send_eof()  # closing from inside a failed write
            else:
                async with self.send_lock:
                    await self.stream.send_eof()
            if self._reading and self._read_scope is not None and _body_unread(self.protocol):
                self._lingering = deferred = True
                deadline = trio.current_time() + LINGER_SECONDS
                self._read_scope.deadline = min(self._read_scope.deadline, deadline)
                return
            with trio.move_on_after(LINGER_SECONDS):
                drained = 0
                while drained < LINGER_BYTES:
                    data = await self.stream.receive_some(65536)
                    if not data:
                        break
                    drained += len(data)
        except (
            trio.BrokenResourceError,
            trio.BusyResourceError,  # the connection's reader is reading: nothing unread
            trio.ClosedResourceError,
            AttributeError,  # a TLS stream has no send_eof
        ):
            pass
        finally:
            if not deferred:
                await self.stream.aclose()


def _body_unread(protocol: object) -> bool:
    """Whether hypercorn's ``ProtocolWrapper`` serves HTTP/1.1 and has answered a request
    whose body has not all arrived."""
    inner = getattr(protocol, "protocol", None)
    return isinstance(inner, ReasonPhraseH11Protocol) and inner.body_unread


class _FragmentCountingBuffer(WebsocketBuffer):
    """Hypercorn's message buffer, refusing a message of more than `MAX_FRAGMENTS` frames.

    Each frame costs the server a few microseconds of parsing on the event loop whatever
    its size: 400,000 one-byte frames of one message stalled every client for seconds.
    The refusal is hypercorn's own for an oversized message (close code 1009).
    """

    def __init__(self, max_length: int) -> None:
        super().__init__(max_length)
        self.num_fragments = 0
        self.too_fragmented = False

    def extend(self, event: Any) -> None:
        self.num_fragments += 1
        if self.num_fragments > MAX_FRAGMENTS:
            self.too_fragmented = True
            raise FrameTooLargeError()
        super().extend(event)

    def clear(self) -> None:
        super().clear()
        self.num_fragments = 0


class EarlyDataWSStream(WSStream):
    """Hypercorn's WebSocket stream, holding bytes that arrive before the handshake ends.

    RFC 6455 has a client wait for the server's handshake response before it sends a
    frame; some send their first frame at once, in the same packet as the request.
    Hypercorn answers such bytes with a 400 that h11 can no longer send. Here they are kept
    (up to ``websocket_max_message_size`` bytes; past that, the connection is closed with
    1009 once accepted) and handed to the connection once the app accepts; if the app
    refuses, they are dropped.
    """

    _early: bytearray | None = None
    _early_overflow = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer = _FragmentCountingBuffer(self.config.websocket_max_message_size)

    async def _handle_events(self) -> None:
        await super()._handle_events()
        if self.buffer.too_fragmented and not self.closed:
            # Hypercorn sent close code 1009; drop the connection too, so the client
            # cannot go on making the server parse frames that lead nowhere.
            await self.send(StreamClosed(stream_id=self.stream_id))

    async def handle(self, event: Any) -> None:
        """Hypercorn's handling, except for data before the handshake is accepted: held
        while the app decides, dropped once it refused (hypercorn would answer a second
        HTTP response in the middle of the first)."""
        if isinstance(event, Body | Data) and not self.closed and not self.handshake.accepted:
            if self.state is ASGIWebsocketState.HANDSHAKE:
                early = self._early if self._early is not None else bytearray()
                if len(early) + len(event.data) <= self.config.websocket_max_message_size:
                    early.extend(event.data)
                else:
                    self._early_overflow = True
                self._early = early
            return
        await super().handle(event)

    async def _accept(self, message: Any) -> None:
        await super()._accept(message)
        if self._early_overflow:
            await self._send_wsproto_event(CloseConnection(code=CloseReason.MESSAGE_TOO_BIG))
            await self.send(StreamClosed(stream_id=self.stream_id))
        elif self._early:
            data, self._early = bytes(self._early), None
            # Another task: the app's queue is bounded, and this runs in the app's task.
            self.task_group.spawn(self.handle, Data(stream_id=self.stream_id, data=data))


def _bound_send_buffer(stream: object) -> None:
    """Cap the kernel's send buffer of a client connection at `SEND_BUFFER_BYTES`.

    Linux grows a connection's send buffer up to 4 MiB (``net.ipv4.tcp_wmem``). For a
    client that stops reading, that is thousands of tokens of output the engine computes
    before the server's writes block and the request is paused (see
    `trio_llm.frontend.engine_client`). A fixed buffer keeps that bounded; token streams
    need far less bandwidth than it allows.
    """
    sock = getattr(stream, "socket", None)  # a TLS stream: left as it is
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError:
            pass


class AcceptErrorFilter(logging.Filter):
    """Let through at most one record per ``interval`` seconds, on one line.

    Trio's accept loop logs an error *with its traceback* every time ``accept`` fails for
    lack of resources (EMFILE, ENFILE, ENOMEM, ENOBUFS), then retries 0.1 s later: ten
    tracebacks a second for as long as the server is out of file descriptors, which buries
    everything else in the log. The condition is worth one line, not a traceback (it is
    always the same one, in Trio's accept). A record that passes has its traceback
    dropped and says how many were left out since the last one.

    Args:
        interval: shortest time between two records let through (seconds).
        clock: the time source (seconds; `time.monotonic`).
    """

    def __init__(
        self,
        interval: float = ACCEPT_ERROR_LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._last: float | None = None
        self._num_left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is written (rewritten to one line when it is)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            self._num_left_out += 1
            return False
        self._last = now
        message = record.getMessage()
        if self._num_left_out:
            message += f" ({self._num_left_out} more like it not shown)"
        self._num_left_out = 0
        record.msg, record.args = message, None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def _install_accept_error_filter() -> None:
    """Give `ACCEPT_LOGGER` one `AcceptErrorFilter` (idempotent)."""
    accept_logger = logging.getLogger(ACCEPT_LOGGER)
    if not any(isinstance(f, AcceptErrorFilter) for f in accept_logger.filters):
        accept_logger.addFilter(AcceptErrorFilter())


def reason_phrase(status: int) -> bytes:
    """The standard reason phrase of ``status`` (``b"Not Found"``), or ``b""`` if none."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


class ReasonPhraseH11Protocol(hypercorn.protocol.h11.H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, with the reason phrase in every status line."""

    @property
    def body_unread(self) -> bool:
        """Whether the client is still sending the current request's body."""
        return self.connection.their_state is h11.SEND_BODY

    async def _send_h11_event(self, event: Any) -> None:
        if isinstance(event, h11.Response | h11.InformationalResponse) and not event.reason:
            kind = type(event)
            event = kind(
                status_code=event.status_code,
                headers=event.headers,
                http_version=event.http_version,
                reason=reason_phrase(event.status_code),
            )
        await super()._send_h11_event(event)


def install() -> None:
    """Make hypercorn's Trio worker use `GuardedTCPServer`, `AnsweredHTTPStream`,
    `EarlyDataWSStream` and `ReasonPhraseH11Protocol`, and Trio's accept loop log through
    `AcceptErrorFilter` (idempotent).

    Raises:
        RuntimeError: this hypercorn version does not build its connections the way this
            guard expects (so the guard would silently not apply).
    """
    patches = [
        (hypercorn.trio.run, "TCPServer", TCPServer, GuardedTCPServer),
        (hypercorn.protocol.h11, "WSStream", WSStream, EarlyDataWSStream),
        (hypercorn.protocol.h2, "WSStream", WSStream, EarlyDataWSStream),
        (hypercorn.protocol.h11, "HTTPStream", HTTPStream, AnsweredHTTPStream),
        (hypercorn.protocol.h2, "HTTPStream", HTTPStream, AnsweredHTTPStream),
        (
            hypercorn.protocol,
            "H11Protocol",
            hypercorn.protocol.h11.H11Protocol,
            ReasonPhraseH11Protocol,
        ),
    ]
    for module, name, original, replacement in patches:
        current = getattr(module, name, None)
        if current is not original and current is not replacement:
            raise RuntimeError(
                f"{module.__name__}.{name} is not what trio_llm's connection guard expects: "
                "this hypercorn version is not supported"
            )
    for module, name, _, replacement in patches:
        setattr(module, name, replacement)
    _install_accept_error_filter()
