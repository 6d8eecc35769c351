"""Framing and typed messages over in-memory streams (no processes)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_llm import ipc
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    RequestOutput,
    SamplingParams,
    Scheduling,
    Shutdown,
    StepOutputs,
    StepStats,
)


def _pair() -> tuple[ipc.FramedStream, ipc.FramedStream]:
    left, right = trio.testing.memory_stream_pair()
    return ipc.FramedStream(left), ipc.FramedStream(right)


async def test_frames_round_trip_including_empty_and_large() -> None:
    a, b = _pair()
    payloads = [b"", b"x", bytes(range(256)) * 1000]
    async with trio.open_nursery() as nursery:

        async def send_all() -> None:
            for payload in payloads:
                await a.send_frame(payload)

        nursery.start_soon(send_all)
        received = [await b.receive_frame() for _ in payloads]
    assert received == payloads


async def test_frames_survive_one_byte_deliveries() -> None:
    send_stream, receive_stream = trio.testing.lockstep_stream_pair()
    sender, receiver = ipc.FramedStream(send_stream), ipc.FramedStream(receive_stream)

    class OneByte(trio.abc.ReceiveStream):
        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            return await receive_stream.receive_some(1)

        async def aclose(self) -> None:
            await receive_stream.aclose()

    receiver.stream = OneByte()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send_frame, b"hello world")
        assert await receiver.receive_frame() == b"hello world"


async def test_clean_end_of_stream_between_frames_is_none() -> None:
    left, right = trio.testing.memory_stream_pair()
    await ipc.FramedStream(left).send_frame(b"last")
    await left.aclose()
    framed = ipc.FramedStream(right)
    assert await framed.receive_frame() == b"last"
    assert await framed.receive_frame() is None


async def test_end_of_stream_inside_a_frame_is_a_protocol_error() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"\x00\x00\x00\x10abc")  # promises 16 bytes, sends 3
    await left.aclose()
    with pytest.raises(ipc.ProtocolError, match="inside a frame"):
        await ipc.FramedStream(right).receive_frame()


async def test_oversized_length_prefix_is_rejected() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"\xff\xff\xff\xff")
    with pytest.raises(ipc.ProtocolError, match="exceeds"):
        await ipc.FramedStream(right).receive_frame()


async def test_typed_messages_round_trip() -> None:
    left, right = trio.testing.memory_stream_pair()
    to_engine = ipc.MessageChannel(ipc.FramedStream(left), object)
    engine_side = ipc.engine_channel(right)
    params = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=7, stop_token_ids=(4,))
    sent = [
        AddRequest("r1", [1, 2, 3], params),
        AddRequest("r2", [4], params, "g", Scheduling(priority=-3, batch=True)),
        AbortRequests(["r1", "r2"]),
        Shutdown(),
    ]
    for message in sent:
        await to_engine.send(message)
    assert [await engine_side.receive() for _ in sent] == sent

    stats = StepStats(1, 2, 3, 4, 5, 6, 0, 0.25)
    outputs = StepOutputs([RequestOutput("r1", [9], "stop")], stats)
    server_side = ipc.server_channel(left)
    await ipc.MessageChannel(ipc.FramedStream(right), object).send(outputs)
    assert await server_side.receive() == outputs


async def test_a_message_of_the_wrong_direction_is_a_protocol_error() -> None:
    left, right = trio.testing.memory_stream_pair()
    await ipc.MessageChannel(ipc.FramedStream(left), object).send(Shutdown())
    with pytest.raises(ipc.ProtocolError):
        await ipc.server_channel(right).receive()


# ------------------------------------------------------------------ cancellation (issue 30)


class _Trickle(trio.abc.SendStream):
    """A send stream that writes ``piece`` bytes per checkpoint and reports its progress,
    as a socket whose peer reads slowly does; after ``stall_after`` bytes it blocks for
    ever (a peer that stopped reading)."""

    def __init__(
        self,
        inner: trio.abc.SendStream,
        piece: int,
        on_sent: object = None,
        stall_after: int | None = None,
    ) -> None:
        self.inner = inner
        self.piece = piece
        self.on_sent = on_sent
        self.stall_after = stall_after
        self.sent = 0
        self.closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        for start in range(0, len(data), self.piece):
            await trio.lowlevel.checkpoint()
            if self.stall_after is not None and self.sent >= self.stall_after:
                await trio.sleep_forever()
            chunk = bytes(data[start : start + self.piece])
            await self.inner.send_all(chunk)
            self.sent += len(chunk)
            if self.on_sent is not None:
                self.on_sent(self.sent)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()


async def _frames_after_a_cancel(payload: bytes, piece: int, cancel_at: int) -> list[bytes]:
    """Send ``payload`` through a trickling stream, cancel the writer once ``cancel_at``
    bytes of it went out, then send a second frame; the frames the peer reads."""
    left, right = trio.testing.memory_stream_pair()
    writer_scope = trio.CancelScope()

    def on_sent(sent: int) -> None:
        if sent >= cancel_at:
            writer_scope.cancel()

    sender = ipc.FramedStream(_Trickle(left, piece, on_sent))
    if cancel_at == 0:
        writer_scope.cancel()
    with writer_scope:
        await sender.send_frame(payload)
    await sender.send_frame(b"next")
    await left.aclose()
    receiver = ipc.FramedStream(right)
    frames = []
    while (frame := await receiver.receive_frame()) is not None:
        frames.append(frame)
    return frames


async def test_a_writer_cancelled_at_any_byte_of_a_frame_still_writes_it_whole() -> None:
    # Every byte offset of a small frame (header included), one byte per write.
    small = bytes(range(100))
    for offset in range(len(small) + 4):
        frames = await _frames_after_a_cancel(small, 1, offset)
        assert frames == ([b"next"] if offset == 0 else [small, b"next"]), offset


async def test_a_writer_cancelled_inside_a_large_frame_still_writes_it_whole() -> None:
    # A frame of the size that wedged the engine (0.7 MB, a whole-vocabulary logit_bias),
    # cancelled at every 16 KiB write.
    large = bytes(range(256)) * 2800
    for offset in range(1, len(large) + 4, 16384):
        assert await _frames_after_a_cancel(large, 16384, offset) == [large, b"next"], offset


async def test_a_frame_that_cannot_be_finished_breaks_the_stream(autojump_clock) -> None:
    left, right = trio.testing.memory_stream_pair()
    trickle = _Trickle(left, 1000, stall_after=3000)  # the peer stops reading mid-frame
    sender = ipc.FramedStream(trickle, write_timeout=5.0)
    start = trio.current_time()
    with pytest.raises(trio.BrokenResourceError, match="could not be written"):
        await sender.send_frame(b"x" * 10_000)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert trickle.closed
    with pytest.raises(trio.BrokenResourceError):
        await sender.send_frame(b"next")
    # The peer reads the cut frame as a broken stream, never as another frame.
    with pytest.raises(ipc.ProtocolError, match="inside a frame"):
        await ipc.FramedStream(right).receive_frame()


async def test_a_cancelled_caller_waits_for_its_frame_at_most_the_write_timeout(
    autojump_clock,
) -> None:
    left, _right = trio.testing.memory_stream_pair()
    sender = ipc.FramedStream(_Trickle(left, 1000, stall_after=1000), write_timeout=5.0)
    start = trio.current_time()
    with trio.move_on_after(1.0), pytest.raises(trio.BrokenResourceError):
        await sender.send_frame(b"x" * 10_000)
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_a_reader_cancelled_at_any_byte_keeps_its_place() -> None:
    send_stream, receive_stream = trio.testing.memory_stream_pair()
    payloads = [bytes(range(200)), b"", b"tail"]
    sender = ipc.FramedStream(send_stream)
    for payload in payloads:
        await sender.send_frame(payload)
    total = sum(len(p) + 4 for p in payloads)

    scope = trio.CancelScope()

    class OneByteThenCancel(trio.abc.ReceiveStream):
        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            data = await receive_stream.receive_some(1)
            scope.cancel()  # the reader's next checkpoint raises Cancelled
            return data

        async def aclose(self) -> None:
            await receive_stream.aclose()

    receiver = ipc.FramedStream(OneByteThenCancel())
    received: list[bytes] = []
    # Cancel the read after every single byte it takes: each frame takes many tries.
    for _ in range(total):
        with scope:
            received.append(await receiver.receive_frame())
        scope = trio.CancelScope()
        if len(received) == len(payloads):
            break
    assert received == payloads
