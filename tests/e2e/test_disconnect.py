"""A client that hangs up aborts its request in the engine and frees its KV blocks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio

from tests.e2e.conftest import completion_body
from tests.support.metrics_scrape import metric, poll, wait_until_idle
from tests.support.sse import delta_text, open_events


@asynccontextmanager
async def _watched(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client for the metrics, once the server is idle; at the end of the block
    (unless it raised), the server is idle again: every request was aborted."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as monitor:
        await wait_until_idle(monitor)
        yield monitor
        await wait_until_idle(monitor)


async def test_closing_a_stream_aborts_the_request(base_url: str) -> None:
    body = completion_body("Tell me a long story.", 4000, stream=True)
    async with _watched(base_url) as monitor:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            received = 0
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    received += bool(delta_text(event))
                    if received == 3:
                        break  # leaves the stream: the connection is closed mid-response
        assert await metric(monitor, "num_requests_running") <= 1


async def test_hanging_up_on_a_non_streaming_request_aborts_it(base_url: str) -> None:
    body = completion_body("Tell me a long story.", 4000)
    async with _watched(base_url) as monitor:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/v1/completions", json=body))
                await poll(partial(metric, monitor, "num_requests_running"), 30)
                nursery.cancel_scope.cancel()  # the client gives up and closes the connection


async def test_hanging_up_aborts_every_choice_of_a_batch(base_url: str) -> None:
    """Two prompts x n=3: six engine requests, all aborted when the client leaves."""
    body = completion_body(["Tell me a long story.", "Write a long poem."], 4000, n=3, stream=True)
    async with _watched(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            seen: set[int] = set()
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    seen.add(event["choices"][0]["index"])
                    if len(seen) == 6:
                        break  # every choice is running; hang up
        assert seen == set(range(6))
