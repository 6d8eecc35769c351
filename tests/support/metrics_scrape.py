"""Reading the server's /metrics from tests: one value, values by engine, a condition,
an idle engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """The value of ``trio_llm:<name>{...}``: the sum of its samples (one per engine).

    Raises:
        AssertionError: /metrics has no such sample.
    """
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in (await client.get("/metrics")).text.splitlines()
        if line.startswith(f"trio_llm:{name}{{")
    ]
    if not values:
        raise AssertionError(f"{name} missing from /metrics")
    return sum(values)


def per_engine(text: str, name: str) -> dict[str, float]:
    """``trio_llm:<name>`` in a /metrics text, by ``engine`` label, summed over its other
    labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"trio_llm:{name}":
                engine = sample.labels["engine"]
                values[engine] = values.get(engine, 0.0) + sample.value
    return values


async def poll(condition: Callable[[], Awaitable[bool]], seconds: float = 10) -> None:
    """Scrape until ``condition()`` holds; /metrics can only be observed by polling.

    Raises:
        trio.TooSlowError: it did not hold within ``seconds``.
    """
    with trio.fail_after(seconds):
        while not await condition():  # noqa: ASYNC110 - nothing to wait on but the scrape
            await trio.sleep(0.05)


async def wait_until_idle(client: httpx.AsyncClient, seconds: float = 10) -> None:
    """Return once no request runs in the engine and no KV block is in use.

    Raises:
        trio.TooSlowError: the engine was not idle within ``seconds``.
    """

    async def idle() -> bool:
        running = await metric(client, "num_requests_running")
        return not running and not await metric(client, "kv_cache_usage_perc")

    await poll(idle, seconds)
