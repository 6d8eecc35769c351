"""EngineClient under supervision: hang detection, waiting through a restart, draining.

The engine is played by the test over in-memory streams (tests/unit/conftest.py's FakeEngine),
and Trio's autojump clock makes the timeouts instant and exact.
"""

from __future__ import annotations

import contextlib

import pytest
import trio
import trio.testing

from tests.unit.conftest import INFO, STATS, FakeEngine, engine_client_pair
from trio_llm import ipc
from trio_llm.errors import (
    EngineDeadError,
    EngineHungError,
    EngineRestartingError,
    EngineShutdownError,
)
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.liveness import UNANSWERED_LIMIT
from trio_llm.messages import HealthReply, Heartbeat, SamplingParams, StepOutputs
from trio_llm.server_config import RestartPolicy

PARAMS = SamplingParams(max_tokens=5)


def _pair(
    step_timeout: float | None = None, restart_wait: float | None = None
) -> tuple[EngineClient, FakeEngine]:
    engine, stream = engine_client_pair(step_timeout=step_timeout, restart_wait=restart_wait)
    return engine, FakeEngine(stream)


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(initial_backoff=0.5, max_backoff=3.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=0)


def _idle_event(nursery: trio.Nursery, engine: EngineClient) -> trio.Event:
    """An event set once ``engine.wait_idle()`` returns (waited for in ``nursery``)."""
    idle = trio.Event()

    async def wait_idle() -> None:
        await engine.wait_idle()
        idle.set()

    nursery.start_soon(wait_idle)
    return idle


async def _consume(engine: EngineClient, outcome: list[BaseException]) -> None:
    """Read one request's stream to its end, keeping the `EngineDeadError` that ends it."""
    async with engine.open_request([1], PARAMS) as stream:
        try:
            async for _ in stream:
                pass
        except EngineDeadError as exc:
            outcome.append(exc)


async def test_silence_past_the_step_timeout_is_a_hang(autojump_clock: trio.abc.Clock) -> None:
    engine, fake = _pair(step_timeout=2.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake.run)
        outcome: list[BaseException] = []

        nursery.start_soon(_consume, engine, outcome)
        start = trio.current_time()
        for _ in range(5):  # heartbeats keep it alive well past the timeout
            await trio.sleep(1.0)
            await fake.server_side.send(Heartbeat(0.0))
        assert engine.is_alive
        fake.answers_health_checks = False  # the engine goes silent (stopped, say)
        await engine.route_outputs()  # returns once the silence reaches 2 s
        assert trio.current_time() - start == pytest.approx(7.0)
        nursery.cancel_scope.cancel()
    assert isinstance(engine.error, EngineHungError)
    assert "no heartbeat for 2 s" in str(engine.error)
    assert isinstance(outcome[0], EngineHungError)
    assert engine.num_hangs == 1 and engine.ended.is_set()


async def test_a_step_running_past_the_timeout_is_a_hang(autojump_clock: trio.abc.Clock) -> None:
    engine, fake = _pair(step_timeout=2.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake.run)
        await fake.server_side.send(Heartbeat(1.5))  # busy, but within the limit
        await fake.server_side.send(Heartbeat(2.5))
        await engine.route_outputs()
        nursery.cancel_scope.cancel()
    assert isinstance(engine.error, EngineHungError)
    assert "a step has run for 2.5 s" in str(engine.error)


async def test_a_loop_that_leaves_health_checks_unanswered_is_a_hang(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Issue 30: the engine's reader was stuck on a misread frame while its heartbeat task
    # went on; every request hung and /health said 200. The round trip sees it.
    engine, fake = _pair(step_timeout=2.0)
    fake.answers_health_checks = False
    outcome: list[BaseException] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake.run)

            async def heartbeats() -> None:
                with contextlib.suppress(trio.BrokenResourceError):  # the server closed it
                    while True:
                        await fake.server_side.send(Heartbeat(0.0))  # idle, and alive
                        await trio.sleep(0.5)

            nursery.start_soon(heartbeats)
            nursery.start_soon(_consume, engine, outcome)
            await engine.route_outputs()
            nursery.cancel_scope.cancel()
    assert isinstance(engine.error, EngineHungError)
    assert "left a health check unanswered for 2 s" in str(engine.error)
    assert isinstance(outcome[0], EngineHungError)
    # The first check goes out after a quarter of the timeout; the verdict 2 s later.
    assert trio.current_time() == pytest.approx(2.5)
    assert fake.num_health_checks == 1 and engine.num_hangs == 1


async def test_a_step_delays_the_answer_without_a_hang(autojump_clock: trio.abc.Clock) -> None:
    # A step in progress holds the answer back: heartbeats saying so keep the engine
    # alive (the step timeout judges the step), and the answer after the step counts.
    engine, fake = _pair(step_timeout=2.0)
    fake.answers_health_checks = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake.run)
        nursery.start_soon(engine.route_outputs)
        for _ in range(4):  # four steps of 1.5 s each, back to back
            for seconds in (0.5, 1.0, 1.5):
                await trio.sleep(0.5)
                await fake.server_side.send(Heartbeat(seconds))
            await fake.server_side.send(StepOutputs([], STATS))
        assert fake.unanswered and engine.is_alive
        await fake.server_side.send(HealthReply(fake.unanswered[-1].seq))
        fake.answers_health_checks = True
        await trio.sleep(5.0)  # idle now, answering
        assert engine.is_alive and engine.error is None and engine.num_hangs == 0
        nursery.cancel_scope.cancel()


async def test_without_hang_detection_an_unanswered_check_is_only_reported(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine, fake = _pair(step_timeout=None)
    fake.answers_health_checks = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake.run)
        nursery.start_soon(engine.route_outputs)
        await trio.sleep(UNANSWERED_LIMIT)
        assert engine.is_alive  # the first check went out a second in
        await trio.sleep(1.5)
        assert not engine.is_alive  # /health says 503, and why:
        assert "left a health check unanswered for 60 s" in str(engine.error)
        await fake.server_side.send(HealthReply(fake.unanswered[-1].seq))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.is_alive and engine.error is None and engine.num_hangs == 0
        nursery.cancel_scope.cancel()


async def test_requests_wait_for_a_restarted_engine(autojump_clock: trio.abc.Clock) -> None:
    engine, fake = _pair(restart_wait=10.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake.run)
        engine.fail_all(EngineDeadError("killed"))
        assert engine.is_restarting and not engine.is_alive and not engine.ended.is_set()
        admission = engine.admit(1, limit=None)  # admitted while restarting
        got: list[str] = []

        async def request() -> None:
            async with engine.open_requests([([1], PARAMS)], admission) as (stream,):
                got.append(stream.request_id)

        nursery.start_soon(request)
        await trio.sleep(3.0)
        assert got == []  # still waiting for the new child
        left, right = trio.testing.memory_stream_pair()
        new_fake = FakeEngine(right)
        nursery.start_soon(new_fake.run)
        engine.attach(ipc.server_channel(left), INFO)
        await new_fake.wait_for_requests(1)
        assert got == new_fake.added and engine.num_restarts == 1 and engine.is_alive
        nursery.cancel_scope.cancel()


async def test_a_restart_slower_than_the_wait_gives_503(autojump_clock: trio.abc.Clock) -> None:
    engine, _ = _pair(restart_wait=4.0)
    engine.fail_all(EngineDeadError("killed"))
    start = trio.current_time()
    with pytest.raises(EngineRestartingError, match="restarting after a failure"):
        async with engine.open_request([1], PARAMS):
            pass
    assert trio.current_time() - start == pytest.approx(4.0)
    engine.give_up(EngineDeadError("gave up"))
    assert engine.ended.is_set()
    with pytest.raises(EngineDeadError, match="gave up"):
        engine.admit(1, limit=None)


async def test_stop_ends_requests_waiting_for_a_restart(autojump_clock: trio.abc.Clock) -> None:
    engine, _ = _pair(restart_wait=30.0)
    engine.fail_all(EngineDeadError("killed"))
    async with trio.open_nursery() as nursery:

        async def stop_soon() -> None:
            await trio.sleep(1.0)
            await engine.stop(5.0)

        nursery.start_soon(stop_soon)
        with pytest.raises(EngineShutdownError):
            async with engine.open_request([1], PARAMS):
                pass
        assert trio.current_time() == pytest.approx(1.0)


async def test_draining_refuses_new_requests_and_waits_for_open_ones() -> None:
    engine, fake = _pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        admitted = engine.admit(1, limit=None)
        async with engine.open_request([1], PARAMS) as stream:
            await fake.wait_for_requests(1)
            engine.close_admissions()
            with pytest.raises(EngineShutdownError):
                engine.admit(1, limit=None)
            idle = _idle_event(nursery, engine)
            await trio.testing.wait_all_tasks_blocked()
            assert not idle.is_set()  # one request open, one admitted
            async with engine.open_requests([([2], PARAMS)], admitted) as (second,):
                await fake.wait_for_requests(2)
                for request in (stream, second):
                    await fake.output(request.request_id, finish="length")
                    assert [d.finish_reason async for d in request][-1] == "length"
        await idle.wait()
        assert engine.is_alive  # draining is not stopping
        nursery.cancel_scope.cancel()


async def test_requests_opened_without_admission_keep_the_client_busy() -> None:
    engine, fake = _pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        await engine.wait_idle()  # nothing open yet
        async with engine.open_request([1], PARAMS) as stream:
            await fake.wait_for_requests(1)
            idle = _idle_event(nursery, engine)
            await trio.testing.wait_all_tasks_blocked()
            assert not idle.is_set()  # one request open, none admitted
            await fake.output(stream.request_id, finish="length")
            assert [d.finish_reason async for d in stream][-1] == "length"
        await idle.wait()
        nursery.cancel_scope.cancel()
