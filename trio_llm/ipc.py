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


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame or message."""


class FramedStream:
    """Sends and receives whole frames over a `trio.abc.Stream`.

    One task may send while another receives. Two tasks must not send at once (trio's
    conflict detection would raise `trio.BusyResourceError`): users with several senders
    hold a `trio.Lock` around each send (`EngineClient`, the engine loop, and the
    detokenizer child's side towards the engine each have one).
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def send_frame(self, payload: bytes) -> None:
        """Send one frame.

        Raises:
            ValueError: the payload is larger than `MAX_FRAME_BYTES`.
            trio.BrokenResourceError: the peer is gone.
        """
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        await self.stream.send_all(_HEADER.pack(len(payload)) + payload)

    async def receive_frame(self) -> bytes | None:
        """Receive one frame; None when the peer closed the stream between frames.

        Raises:
            ProtocolError: end of stream inside a frame, or a length over the limit.
            trio.BrokenResourceError: the connection broke.
        """
        header = await self._receive_exactly(_HEADER.size, allow_eof=True)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame length {length} exceeds {MAX_FRAME_BYTES}")
        payload = await self._receive_exactly(length, allow_eof=False)
        assert payload is not None
        return payload

    async def _receive_exactly(self, n: int, *, allow_eof: bool) -> bytes | None:
        while len(self._buffer) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self._buffer)))
            if not chunk:
                if allow_eof and not self._buffer:
                    return None
                raise ProtocolError(f"stream ended inside a frame ({len(self._buffer)}/{n} bytes)")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

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
