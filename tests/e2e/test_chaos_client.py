"""The chaos harness's own clients against a healthy server: each kind of request ends
as it should when nothing goes wrong, so that a failed trial means a server fault and
not a broken client (two harness bugs once showed up only as failed long-run trials)."""

from __future__ import annotations

import random
import time

import pytest

from tests.support.load import Load, Record, burst


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("sse", "complete"), ("json", "complete"), ("ws", "complete"), ("leaver", "left")],
)
async def test_load_client_ends_normally(base_url: str, kind: str, expected: str) -> None:
    load = Load(base_url, random.Random(3))
    record = Record(kind, time.monotonic())
    outcome, detail = await load.one_request(kind, record)
    assert (outcome, detail) == (expected, "")
    assert record.phase != "starting"  # the client says where it is


async def test_burst_requests_all_end(base_url: str) -> None:
    records = await burst(base_url, 3)
    assert [r.kind for r in records] == ["burst"] * 3
    assert all(r.outcome == "complete" for r in records), [(r.outcome, r.detail) for r in records]
    assert all(r.end >= r.start for r in records)
