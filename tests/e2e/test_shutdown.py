"""Signals and crashes end the same predictable way: every client sees an end, no orphans."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

from tests.e2e.conftest import completion_body
from tests.support.procfs import (
    detokenizer_children,
    engine_children,
    is_running,
    server_children,
    wait_for_exit,
)
from tests.support.server_process import ServerProcess
from tests.support.sse import DONE, delta_text, open_events

ARGS = ["--max-num-seqs", "16", "--kv-cache-memory", "512MiB"]


@pytest.fixture
def fresh_server(request: pytest.FixtureRequest, tmp_path: Path, real_model_dir: Path):
    """A server of its own, in the detokenizer mode the test is parametrized with (each
    test runs in one mode: the chaos suite covers every fault in both)."""
    args = [*ARGS, "--detokenizer-mode", request.param]
    server = ServerProcess(args, log_path=tmp_path / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


async def _streams_then(server: ServerProcess, n: int, fault) -> dict[int, str]:
    """Run ``n`` long streams; once each has text, call ``fault()``; return how each ended."""
    outcome: dict[int, str] = {}
    all_started = trio.Semaphore(0)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def stream(i: int) -> None:
            body = completion_body(f"Essay {i}:", 3000, stream=True)
            started = False
            try:
                async with open_events(client, "/v1/completions", body) as events:
                    async for event in events:
                        if event == DONE:
                            outcome.setdefault(i, "done")
                        elif "error" in event:
                            outcome[i] = "error: " + event["error"]["message"]
                        elif delta_text(event) and not started:
                            started = True
                            all_started.release()
            except httpx.HTTPError as exc:
                outcome[i] = f"transport: {exc!r}"
            outcome.setdefault(i, "ended without [DONE]")

        with trio.CancelScope() as deadline:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(stream, i)
                for _ in range(n):
                    await all_started.acquire()
                fault()
                deadline.deadline = trio.current_time() + 10  # every client ends by then
        assert not deadline.cancelled_caught, (
            f"clients still waiting 10 s after the fault: {outcome}"
        )
    return outcome


@pytest.mark.parametrize("fresh_server", ["inline"], indirect=True)
async def test_sigint_ends_every_stream_and_exits_0(fresh_server: ServerProcess) -> None:
    engines = server_children(fresh_server.pid)
    assert len(engine_children(fresh_server.pid)) == 1
    start = time.monotonic()
    outcome = await _streams_then(fresh_server, 8, lambda: fresh_server.send_signal(signal.SIGINT))
    code = await trio.to_thread.run_sync(fresh_server.wait, 10)
    assert time.monotonic() - start < 10
    assert code == 0, fresh_server.log()
    assert set(outcome.values()) == {"error: the server is shutting down"}, outcome
    assert not any(is_running(pid) for pid in engines)
    assert "stopped (received SIGINT)" in fresh_server.log()


@pytest.mark.parametrize("fresh_server", ["process"], indirect=True)
async def test_killing_the_engine_fails_streams_and_exits_nonzero(
    fresh_server: ServerProcess,
) -> None:
    (engine,) = engine_children(fresh_server.pid)
    killed_at: list[float] = []

    def kill_engine() -> None:
        killed_at.append(time.monotonic())
        os.kill(engine, signal.SIGKILL)

    outcome = await _streams_then(fresh_server, 4, kill_engine)
    assert time.monotonic() - killed_at[0] < 5
    assert all(v.startswith("error: engine core died") for v in outcome.values()), outcome
    code = await trio.to_thread.run_sync(fresh_server.wait, 10)
    assert code == 1
    last_line = fresh_server.log().strip().splitlines()[-1]
    assert last_line.startswith("trio-llm: error: engine core died") and "SIGKILL" in last_line


@pytest.mark.parametrize("fresh_server", ["process"], indirect=True)
async def test_killing_the_server_takes_the_engine_with_it(fresh_server: ServerProcess) -> None:
    children = server_children(fresh_server.pid)
    assert children
    fresh_server.send_signal(signal.SIGKILL)
    await trio.to_thread.run_sync(fresh_server.wait, 5)
    with trio.fail_after(5):
        for child in children:
            await wait_for_exit(child)


async def test_killing_the_detokenizer_fails_streams_and_exits_nonzero(
    tmp_path: Path, real_model_dir: Path
) -> None:
    """3-process mode: the detokenizer's death is the engine's death to the server (the
    engine core follows it out), never silent. (At --log-level debug, which reaches both
    children.)"""
    args = [*ARGS, "--detokenizer-mode", "process", "--log-level", "debug"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        (detokenizer,) = detokenizer_children(server.pid)
        (engine,) = engine_children(server.pid)
        outcome = await _streams_then(server, 4, lambda: os.kill(detokenizer, signal.SIGKILL))
        assert all(v.startswith("error: engine core died") for v in outcome.values()), outcome
        code = await trio.to_thread.run_sync(server.wait, 10)
        assert code == 1
        last_line = server.log().strip().splitlines()[-1]
        assert "detokenizer: killed by SIGKILL" in last_line, last_line
        lines = server.log().splitlines()  # the children's debug lines are there
        assert any(line.startswith("trio-llm engine: engine core ") for line in lines)
        assert any(line.startswith("trio-llm detokenizer: detokenizing for ") for line in lines)
        with trio.fail_after(5):
            await wait_for_exit(engine)
