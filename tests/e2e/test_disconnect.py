"""A client that hangs up aborts its request in the engine and frees its KV blocks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import httpx
import trio

from tests.e2e.conftest import MODEL
from trio_llm.testing.sse import delta_text, open_events


async def _gauge(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"trio_llm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


async def _poll(condition: Callable[[], Awaitable[bool]], seconds: float) -> None:
    """Scrape until ``condition()`` holds; /metrics can only be observed by polling."""
    with trio.fail_after(seconds):
        while not await condition():  # noqa: ASYNC110 - nothing to wait on but the scrape
            await trio.sleep(0.05)


async def _wait_until_idle(client: httpx.AsyncClient) -> None:
    """No request runs and no KV block is used, within 5 s."""

    async def idle() -> bool:
        running = await _gauge(client, "num_requests_running")
        return not running and not await _gauge(client, "kv_cache_usage_perc")

    await _poll(idle, 5)


async def test_closing_a_stream_aborts_the_request(base_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as monitor:
        await _wait_until_idle(monitor)
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            received = 0
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    received += bool(delta_text(event))
                    if received == 3:
                        break  # leaves the stream: the connection is closed mid-response
        assert await _gauge(monitor, "num_requests_running") <= 1
        await _wait_until_idle(monitor)


async def test_hanging_up_on_a_non_streaming_request_aborts_it(base_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as monitor:
        await _wait_until_idle(monitor)
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/v1/completions", json=body))
                await _poll(partial(_gauge, monitor, "num_requests_running"), 30)
                nursery.cancel_scope.cancel()  # the client gives up and closes the connection
        await _wait_until_idle(monitor)


async def test_hanging_up_aborts_every_choice_of_a_batch(base_url: str) -> None:
    """Two prompts x n=3: six engine requests, all aborted when the client leaves."""
    body = {
        "model": MODEL,
        "prompt": ["Tell me a long story.", "Write a long poem."],
        "n": 3,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as monitor:
        await _wait_until_idle(monitor)
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            seen: set[int] = set()
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    seen.add(event["choices"][0]["index"])
                    if len(seen) == 6:
                        break  # every choice is running; hang up
        assert seen == set(range(6))
        await _wait_until_idle(monitor)
