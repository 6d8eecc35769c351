"""A small client for the server-sent-event streams of the OpenAI routes (tests, bench)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx

DONE = "[DONE]"


@asynccontextmanager
async def open_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[AsyncIterator[dict[str, Any] | str]]:
    """POST ``body``; yield an iterator over its ``data:`` events (JSON, or ``"[DONE]"``).

    Leaving the block closes the response (the connection) at once, even mid-stream.

    Raises:
        httpx.HTTPStatusError: the server answered with an error status instead of a stream.
    """
    async with aclosing(_iter_events(client, path, body)) as events:
        yield events


async def _iter_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any] | str]:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            yield DONE if data == DONE else json.loads(data)


def delta_text(event: dict[str, Any]) -> str:
    """Text carried by a completion or chat chunk ('' when none)."""
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""
