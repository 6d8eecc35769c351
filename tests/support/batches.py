"""Driving ``/v1/files`` and ``/v1/batches`` from tests, and checking a batch's output:
every ``custom_id`` exactly once, each result what the same request sent online gets."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import httpx
from openai import OpenAI

from tests.support.load import MODEL

#: Statuses of a batch that is over.
FINAL = ("completed", "failed", "expired", "cancelled")

#: Fields that differ between two answers to the same request: ids, times, and the
#: prefix-cache hits (which depend on what ran before).
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "request_id", "cached_tokens"})


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One input line of a batch."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def completion_lines(count: int, max_tokens: int, prefix: str = "c") -> list[dict[str, Any]]:
    """``count`` greedy ``/v1/completions`` lines, each generating ``max_tokens`` tokens."""
    return [
        line(
            f"{prefix}{i}",
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": f"Story number {i}:",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        for i in range(count)
    ]


def jsonl(lines: Iterable[dict[str, Any] | str]) -> bytes:
    """The lines as a JSONL file (a ``str`` is written as it is: a malformed line)."""
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def start_batch(client: OpenAI, lines: Iterable[dict[str, Any] | str], endpoint: str) -> str:
    """Upload ``lines`` (purpose ``batch``) and create a batch of them; its id."""
    upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,
        completion_window="24h",  # type: ignore[arg-type]
    )
    return batch.id


def wait_for_batch(
    client: OpenAI, batch_id: str, statuses: tuple[str, ...] = FINAL, seconds: float = 240
) -> Any:
    """Poll the batch until its status is one of ``statuses``; the Batch object.

    Raises:
        TimeoutError: not within ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status}: {batch}")
        time.sleep(0.2)


def wait_for_progress(client: OpenAI, batch_id: str, done: int, seconds: float = 240) -> Any:
    """Poll the batch until ``done`` of its lines have a result; the Batch object."""
    deadline = time.monotonic() + seconds
    while True:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        if counts is not None and counts.completed + counts.failed >= done:
            return batch
        if batch.status in FINAL or time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} did not reach {done} results: {batch}")
        time.sleep(0.1)


def file_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The parsed lines of a stored file (none for no file)."""
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def normalized(value: Any) -> Any:
    """``value`` without its `VOLATILE` fields, at any depth."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalized(item) for item in value]
    return value


def online(base_url: str, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and JSON body of ``body`` sent to the server at ``base_url``."""
    response = httpx.post(f"{base_url}{url}", json=body, timeout=120)
    return response.status_code, response.json()


def exactly_once_failures(inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a batch's output lines for ``inputs`` (whose lines all
    succeed): a ``custom_id`` missing, twice, or unknown; a result that is not a 200;
    the lines out of input order."""
    wanted = [item["custom_id"] for item in inputs]
    got = [item["custom_id"] for item in outputs]
    failures = []
    counts = Counter(got)
    missing = [cid for cid in wanted if counts[cid] == 0]
    twice = [cid for cid, n in counts.items() if n > 1]
    unknown = sorted(set(got) - set(wanted))
    if missing:
        failures.append(f"custom_ids missing from the output: {missing}")
    if twice:
        failures.append(f"custom_ids more than once in the output: {twice}")
    if unknown:
        failures.append(f"custom_ids in the output that were never asked: {unknown}")
    if not (missing or twice or unknown) and got != wanted:
        failures.append("the output is not in input order")
    bad = [o["custom_id"] for o in outputs if (o.get("response") or {}).get("status_code") != 200]
    if bad:
        failures.append(f"lines without a 200: {bad}")
    return failures
