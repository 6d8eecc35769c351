"""The engine loop's wait for a message that a finished grammar compile ends (`_Wakeup`):
no process, no model; the compile is played by a test thread."""

from __future__ import annotations

import trio
import trio.testing

from trio_llm.engine.loop import _Wakeup
from trio_llm.messages import AbortRequests, ToEngine


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
