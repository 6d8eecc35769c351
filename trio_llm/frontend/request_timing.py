"""Per-request timing for metrics: `RequestRecord`, `RequestObserver`, `EngineStats`,
and the two moments that update them (`count_tokens`, `record_finished`).

Time to first token, inter-token latency and end-to-end latency are measured by the
`EngineClient` when outputs arrive, with this process's monotonic clock, and reported to
an optional `RequestObserver` (the Prometheus metrics). The queue time is measured by the
engine process with its own clock and shipped as a duration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from trio_llm.messages import StepStats


@dataclass
class RequestRecord:
    """Timing and counts of one engine request, for metrics (seconds, monotonic clock).

    Attributes:
        finish_reason: "stop", "length" or "abort" (abort: the engine or the client ended
            it before it finished).
        first_token_seconds: arrival -> first output token, None if there was none.
        queue_seconds: arrival in the engine -> first scheduled (measured by the engine).
    """

    num_prompt_tokens: int
    arrival: float
    num_output_tokens: int = 0
    first_token_seconds: float | None = None
    last_token_time: float | None = None
    queue_seconds: float | None = None
    finish_reason: str | None = None
    e2e_seconds: float = 0.0


def count_tokens(
    record: RequestRecord, count: int, now: float, observer: RequestObserver | None
) -> None:
    """``count`` output tokens of ``record``'s request arrived at ``now`` (monotonic)."""
    previous = record.last_token_time
    record.num_output_tokens += count
    record.last_token_time = now
    if previous is None:
        record.first_token_seconds = now - record.arrival
        if observer is not None:
            observer.on_first_token(record)
        count -= 1  # the first token has no interval before it
        previous = now
    if count > 0 and observer is not None:
        observer.on_tokens(now - previous, count)


def record_finished(record: RequestRecord, reason: str, observer: RequestObserver | None) -> None:
    """``record``'s request ended now with ``reason``."""
    record.finish_reason = reason
    record.e2e_seconds = time.monotonic() - record.arrival
    if observer is not None:
        observer.on_finished(record)


class RequestObserver(Protocol):
    """Receives per-request timing as it happens (implemented by the metrics)."""

    def on_first_token(self, record: RequestRecord) -> None:
        """The first output token arrived (``record.first_token_seconds`` is set)."""

    def on_tokens(self, interval: float, count: int) -> None:
        """``count`` tokens arrived ``interval`` seconds after the previous one(s)."""

    def on_finished(self, record: RequestRecord) -> None:
        """The request ended (``finish_reason`` and ``e2e_seconds`` are set)."""


@dataclass
class EngineStats:
    """Counters kept from the engine's per-step stats (read by tests, benchmarks, metrics)."""

    num_steps: int = 0
    num_multi_request_steps: int = 0
    num_preemptions: int = 0
    last: StepStats | None = None

    def add_step(self, step: StepStats) -> None:
        """Count one step's stats (``last`` is kept even for an idle report)."""
        self.last = step
        if step.num_scheduled_reqs:
            self.num_steps += 1
            self.num_multi_request_steps += step.num_scheduled_reqs > 1
            self.num_preemptions += step.num_preemptions
