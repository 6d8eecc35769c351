"""--data-parallel-size 2 on a real server: both engines serve (and agree), one engine's
SIGKILL fails only its own streams while the other serves on and it restarts, and a
SIGKILL of the server takes every child with it.

One server lives through the steps in order; each checks what clients, /health and
/metrics see. The routing rules themselves are pinned in tests/unit/frontend/test_data_parallel.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.e2e.conftest import MODEL
from tests.support.metrics_scrape import per_engine, poll
from tests.support.procfs import descendants, engine_children, is_running, wait_for_exit
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess
from tests.support.sse import DONE, open_events

ARGS = [
    *SMALL_SERVER_ARGS,
    # float32: greedy outputs do not depend on which requests share a step (bfloat16's
    # products round differently with the batch, so the same request may diverge).
    "--dtype",
    "float32",
    "--data-parallel-size",
    "2",
    "--engine-restart",
    "on-failure",
    "--engine-step-timeout",
    "20",
]


async def _per_engine(client: httpx.AsyncClient, name: str) -> dict[str, float]:
    return per_engine((await client.get("/metrics")).text, name)


async def _stream(client: httpx.AsyncClient, prompt: str, started: trio.Event) -> str:
    """One greedy streamed completion: its text, or "error: <message>"."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0}
    body.update(ignore_eos=True, stream=True)
    text, error = "", ""
    async with open_events(client, "/v1/completions", body) as events:
        async for event in events:
            if event == DONE:
                return f"error: {error}" if error else text
            if "error" in event:
                error = event["error"]["message"]
            else:
                text += event["choices"][0]["text"]
            started.set()
    return "error: ended without [DONE]"


async def _streams(client: httpx.AsyncClient, count: int, fault=None) -> list[str]:
    """``count`` concurrent streams of the same prompt (each started before the next, so
    the engines take them in turn); ``fault()`` once all produce text; their outcomes."""
    outcomes: list[str] = []

    async def one(started: trio.Event) -> None:
        outcomes.append(await _stream(client, "The history of the printing press", started))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            started = trio.Event()
            nursery.start_soon(one, started)
            await started.wait()
        if fault is not None:
            fault()
    return outcomes


@pytest.mark.long
async def test_two_engines_serve_fail_alone_and_die_with_the_server(
    tmp_path: Path, real_model_dir: Path
) -> None:
    server = ServerProcess(ARGS, log_path=tmp_path / "server.log")
    await trio.to_thread.run_sync(server.start)
    try:
        engines = engine_children(server.pid)
        assert len(engines) == 2
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            # 1. Both engines take work, and the same greedy request gets the same text.
            outcomes = await _streams(client, 4)
            assert len(set(outcomes)) == 1 and not outcomes[0].startswith("error"), outcomes
            served = await _per_engine(client, "request_success_total")
            assert served == {"0": 2.0, "1": 2.0}, served
            assert (await client.get("/health")).status_code == 200

            # 2. SIGKILL one engine: only its two streams fail; the other engine serves.
            victim = min(engines)
            outcomes = await _streams(client, 4, lambda: os.kill(victim, signal.SIGKILL))
            failed = [o for o in outcomes if o.startswith("error")]
            assert len(failed) == 2, outcomes
            assert all(o.startswith("error: engine core died") for o in failed), outcomes
            health = await client.get("/health")
            assert health.status_code == 200
            if health.content:  # not yet restarted: degraded, with the count
                assert health.json()["engines_serving"] == 1, health.text
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
            assert (await client.post("/v1/completions", json=body)).status_code == 200

            async def restarted() -> bool:
                return (await client.get("/health")).content == b""

            await poll(restarted, 60)
            restarts = await _per_engine(client, "engine_restarts_total")
            assert sorted(restarts.values()) == [0.0, 1.0], restarts
            now = engine_children(server.pid)
            assert len(now) == 2 and victim not in now and not is_running(victim)
            healthy = await _per_engine(client, "engine_healthy")
            assert healthy == {"0": 1.0, "1": 1.0}
        assert re.search(r"engine core [01] failed: .*restarting it in", server.log())

        # 3. SIGKILL of the server: the kernel takes every child with it.
        tree = descendants(server.pid)
        assert len(engine_children(server.pid)) == 2
        server.send_signal(signal.SIGKILL)
        await trio.to_thread.run_sync(server.wait, 10)
        with trio.fail_after(10):
            for pid in tree:
                await wait_for_exit(pid)
    finally:
        server.close()
