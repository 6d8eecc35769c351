"""The engine loop without a process or a model: its wait for a message that a finished
grammar compile ends (`_Wakeup`; the compile is played by a test thread), and its answers to
health checks (an idle core played by the test)."""

from __future__ import annotations

import trio
import trio.testing

from trio_llm import ipc
from trio_llm.engine.loop import _Outbox, _serve, _Wakeup
from trio_llm.messages import (
    AbortRequests,
    HealthCheck,
    HealthReply,
    Shutdown,
    StepOutputs,
    StepStats,
    ToEngine,
)


async def test_a_compile_finishing_in_another_thread_ends_the_wait() -> None:
    send, inbox = trio.open_memory_channel[ToEngine](10)
    wakeup = _Wakeup()
    compiled = False
    received: list[ToEngine | None] = []

    async def wait() -> None:
        received.append(await wakeup.receive(inbox, lambda: compiled))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert received == []  # waiting for a message

        def finish_compile() -> None:  # the grammar worker thread
            nonlocal compiled
            compiled = True
            wakeup.notify()

        await trio.to_thread.run_sync(finish_compile)
    assert received == [None]

    # Done before the wait begins: no wait at all; and a message is not lost either way.
    assert await wakeup.receive(inbox, lambda: True) is None
    send.send_nowait(AbortRequests(["r"]))
    assert await wakeup.receive(inbox, lambda: True) is None
    assert await wakeup.receive(inbox, lambda: False) == AbortRequests(["r"])


async def test_a_notification_without_a_wait_does_nothing() -> None:
    send, inbox = trio.open_memory_channel[ToEngine](10)
    wakeup = _Wakeup()
    await trio.to_thread.run_sync(wakeup.notify)
    await trio.testing.wait_all_tasks_blocked()  # the notification is handled now
    send.send_nowait(AbortRequests(["r"]))
    assert await wakeup.receive(inbox, lambda: False) == AbortRequests(["r"])


class _IdleCore:
    """An engine core with nothing to do (the loop's view of one)."""

    on_grammar_event = None

    def has_work(self) -> bool:
        return False

    def stats(self) -> StepStats:
        return StepStats(0, 0, 0, 0, 0, 64, 0, 0.0)

    def abort(self, request_ids: list[str]) -> None:
        pass


async def test_the_loop_answers_health_checks_in_order_and_reports_nothing_else() -> None:
    server_end, engine_end = trio.testing.memory_stream_pair()
    to_engine = ipc.MessageChannel(ipc.FramedStream(server_end), object)
    from_engine = ipc.server_channel(server_end)
    outbox = _Outbox(ipc.engine_channel(engine_end))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve, _IdleCore(), outbox, 3600.0)
        await to_engine.send(HealthCheck(1))
        assert await from_engine.receive() == HealthReply(1)
        # After an abort, the idle engine reports its stats once; then the next answer.
        await to_engine.send(AbortRequests(["r"]))
        await to_engine.send(HealthCheck(2))
        received = [await from_engine.receive(), await from_engine.receive()]
        assert isinstance(received[0], StepOutputs) and received[1] == HealthReply(2)
        await to_engine.send(HealthCheck(3))
        assert await from_engine.receive() == HealthReply(3)  # no idle report before it
        await to_engine.send(Shutdown())
