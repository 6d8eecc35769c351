"""The supervisor's signal handling (real signals to this process, caught by Trio):
SIGTERM drains, a second signal skips the drain, one more cancels everything."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from trio_llm.server.supervisor import Lifecycle, _handle_signals


@asynccontextmanager
async def _handling_signals(
    lifecycle: Lifecycle,
) -> AsyncIterator[tuple[trio.CancelScope, trio.Nursery]]:
    """The supervisor's signal handler running for ``lifecycle``; yields its root scope
    (the one the handler cancels) and the nursery it runs in."""
    with trio.CancelScope() as root:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_handle_signals, lifecycle, root)
            await trio.testing.wait_all_tasks_blocked()
            yield root, nursery


async def _signal(signum: int) -> None:
    os.kill(os.getpid(), signum)
    await trio.testing.wait_all_tasks_blocked()


async def test_sigterm_drains_then_a_second_signal_skips_then_a_third_cancels() -> None:
    lifecycle = Lifecycle(serving=True)
    async with _handling_signals(lifecycle) as (root, _):
        await _signal(signal.SIGTERM)
        assert lifecycle.stop_requested.is_set() and lifecycle.drain
        assert lifecycle.reason == "received SIGTERM" and lifecycle.exit_code == 0
        assert not lifecycle.drain_scope.cancel_called
        await _signal(signal.SIGINT)
        assert lifecycle.drain_scope.cancel_called  # the drain's wait ends now
        assert not root.cancel_called
        lifecycle.aborting = True  # the shutdown is ending requests
        await _signal(signal.SIGTERM)
        assert root.cancel_called
    assert lifecycle.reason == "received SIGTERM"  # the first reason is kept


async def test_sigint_stops_without_draining_and_start_up_signals_cancel() -> None:
    lifecycle = Lifecycle(serving=True)
    async with _handling_signals(lifecycle) as (_, nursery):
        await _signal(signal.SIGINT)
        assert lifecycle.stop_requested.is_set() and not lifecycle.drain
        nursery.cancel_scope.cancel()
    starting = Lifecycle(serving=False)
    async with _handling_signals(starting) as (root, _):
        await _signal(signal.SIGTERM)
    assert root.cancelled_caught and starting.stop_requested.is_set()
