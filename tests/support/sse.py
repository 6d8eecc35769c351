"""A small client for the server-sent-event streams of the OpenAI routes (tests, bench),
and the parsing of a stream already read (`named_events`, `names_and_data`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
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


def _fields(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """The ``event:`` and ``data:`` fields of a stream's lines: ``(field, value)``."""
    for line in lines:
        for field in ("event", "data"):
            if line.startswith(f"{field}: "):
                yield field, line.removeprefix(f"{field}: ")


def named_events(text: str) -> list[tuple[str | None, Any]]:
    """The server-sent events of a whole stream's ``text``: ``(event name, data)``, the
    data parsed as JSON (``"[DONE]"`` as it is), the name None where none came before it."""
    events: list[tuple[str | None, Any]] = []
    name = None
    for field, value in _fields(text.splitlines()):
        if field == "event":
            name = value
        else:
            events.append((name, value if value == DONE else json.loads(value)))
            name = None
    return events


def names_and_data(lines: Iterable[str]) -> tuple[list[str], list[Any]]:
    """Every ``event:`` name and every ``data:`` value (JSON) of a stream's lines, in two
    lists (a caller checks that they pair up)."""
    fields = list(_fields(lines))
    names = [value for field, value in fields if field == "event"]
    return names, [json.loads(value) for field, value in fields if field == "data"]
