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
    sent = [AddRequest("r1", [1, 2, 3], params), AbortRequests(["r1", "r2"]), Shutdown()]
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
