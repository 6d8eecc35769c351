"""Length-prefixed framing over any Trio byte stream, and typed message channels on top.

Frame format: a 4-byte big-endian unsigned length ``n`` followed by ``n`` payload bytes.
Payloads are MessagePack-encoded `trio_llm.messages` structs, except the start-up config
frame, which is cloudpickle bytes. Works on socket streams and on
`trio.testing.memory_stream_pair`, so it is tested without processes.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Generic, TypeVar

import msgspec
import trio

from trio_llm import messages

_HEADER = struct.Struct(">I")

#: Largest frame accepted (bytes); a bigger length prefix means a corrupt stream.
MAX_FRAME_BYTES = 256 * 1024 * 1024

#: Seconds one frame may take to write before the stream counts as broken (a peer that
#: stopped reading); `FramedStream`'s default.
WRITE_TIMEOUT = 60.0


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame or message."""


#: What a send or receive raises once the peer is gone or the channel was closed.
CHANNEL_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)

#: `CHANNEL_CLOSED`, or the peer sent bytes that are no message: the channel is unusable.
CHANNEL_BROKEN = (*CHANNEL_CLOSED, ProtocolError)


def channel_closed(
    exc: BaseException, kinds: tuple[type[BaseException], ...] = CHANNEL_CLOSED
) -> bool:
    """True if ``exc`` (or every leaf of an exception group) is one of ``kinds``: the
    channel is gone, which ends a process quietly rather than as a failure."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(kinds)[1] is None
    return isinstance(exc, kinds)


class FramedStream:
    """Sends and receives whole frames over a `trio.abc.Stream`.

    One task may send while another receives. Two tasks must not send at once (trio's
    conflict detection would raise `trio.BusyResourceError`): users with several senders
    hold a `trio.Lock` around each send (`EngineClient`, the engine loop, and the
    detokenizer child's side towards the engine each have one).

    A frame is never cut by a cancellation, on either side. A sender cancelled before its
    frame's first byte sends nothing; once a frame has begun it is written whole, shielded
    from the caller's cancellation, within ``write_timeout`` seconds. A frame that cannot
    be finished in that time (the peer stopped reading) or whose write fails breaks the
    stream for good: it is closed, so the peer sees a broken stream rather than a frame
    that is not one, and every later send raises `trio.BrokenResourceError`. A receiver
    cancelled inside a frame keeps what it read: the next call goes on from there.

    Args:
        stream: the byte stream (a socket stream, or a memory stream in tests).
        write_timeout: seconds one frame may take to write (see above).
    """

    def __init__(self, stream: trio.abc.Stream, write_timeout: float = WRITE_TIMEOUT) -> None:
        self.stream = stream
        self.write_timeout = write_timeout
        self._buffer = bytearray()
        #: Why sending is no longer possible (a frame was cut off), or None.
        self._broken: str | None = None

    async def send_frame(self, payload: bytes) -> None:
        """Send one frame, whole (see the class).

        Raises:
            ValueError: the payload is larger than `MAX_FRAME_BYTES`.
            trio.BrokenResourceError: the peer is gone, or this frame or an earlier one
                could not be written whole.
            trio.ClosedResourceError: the stream was closed.
        """
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)
        await trio.lowlevel.checkpoint_if_cancelled()
        data = _HEADER.pack(len(payload)) + payload
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.write_timeout
            try:
                await self.stream.send_all(data)
            except BaseException as exc:
                self._broken = f"an earlier frame could not be written: {exc!r}"
                if not isinstance(exc, trio.Cancelled):
                    raise
            else:
                return
        # Only the write timeout ends the shielded scope early.
        self._broken = f"a frame could not be written within {self.write_timeout:g} s"
        with trio.CancelScope(shield=True):
            await self.stream.aclose()
        raise trio.BrokenResourceError(self._broken)

    async def receive_frame(self) -> bytes | None:
        """Receive one frame; None when the peer closed the stream between frames.

        Raises:
            ProtocolError: end of stream inside a frame, or a length over the limit.
            trio.BrokenResourceError: the connection broke.
        """
        buffer = self._buffer
        while True:
            needed = _HEADER.size
            if len(buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer)
                if length > MAX_FRAME_BYTES:
                    raise ProtocolError(f"frame length {length} exceeds {MAX_FRAME_BYTES}")
                needed += length
                if len(buffer) >= needed:
                    payload = bytes(buffer[_HEADER.size : needed])
                    del buffer[:needed]
                    return payload
            # Bytes join the buffer only once received: a cancelled read loses nothing.
            chunk = await self.stream.receive_some(max(65536, needed - len(buffer)))
            if not chunk:
                if not buffer:
                    return None
                raise ProtocolError(f"stream ended inside a frame ({len(buffer)}/{needed} bytes)")
            buffer += chunk

    async def aclose(self) -> None:
        """Close the underlying stream."""
        await self.stream.aclose()


T = TypeVar("T")


class MessageChannel(Generic[T]):
    """Typed messages over a `FramedStream`: sends any struct, receives the union ``T``.

    Example: the server side is ``MessageChannel[messages.FromEngine]``.
    """

    def __init__(self, framed: FramedStream, receive_type: Any) -> None:
        self.framed = framed
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receive_type)

    async def send(self, message: msgspec.Struct) -> None:
        """Encode and send one message (raises like `FramedStream.send_frame`)."""
        await self.framed.send_frame(self._encoder.encode(message))

    async def receive(self) -> T | None:
        """The next message, or None at end of stream.

        Raises:
            ProtocolError: the frame does not decode to the expected union.
        """
        frame = await self.framed.receive_frame()
        if frame is None:
            return None
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable message: {exc}") from exc

    async def aclose(self) -> None:
        """Close the underlying stream."""
        await self.framed.aclose()


def server_channel(stream: trio.abc.Stream) -> MessageChannel[messages.FromEngine]:
    """The API server's end: receives what the engine sends."""
    return MessageChannel(FramedStream(stream), messages.FromEngine)


def engine_channel(stream: trio.abc.Stream) -> MessageChannel[messages.ToEngine]:
    """The engine's end: receives what the server sends."""
    return MessageChannel(FramedStream(stream), messages.ToEngine)


def socket_stream_from_fd(fd: int) -> trio.SocketStream:
    """Wrap an inherited Unix socket file descriptor as a Trio stream (takes ownership)."""
    sock = socket.socket(fileno=fd)
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))
