"""`ScheduledBatch`: the work of one engine step, as the scheduler
(`trio_llm.engine.scheduler`) hands it to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from trio_llm.engine.request import Request


@dataclass
class ScheduledBatch:
    """The work of one step.

    Attributes:
        requests: the scheduled requests with the number of new tokens each computes,
            rank by rank (`trio_llm.engine.request_queue`): the running requests of a rank
            in the running queue's order, and those admitted this step in admission order
            (before the running ones of a worse rank). (The model runner packs
            single-token requests first, then the longer chunks, each part in this order.)
        num_preemptions: requests preempted while building this batch.
        num_prefill_tokens: the scheduled tokens that are not decodes (a decode feeds a
            running request's last sampled token; a one-token prompt or last prompt
            chunk is prefill).
    """

    requests: list[tuple[Request, int]] = field(default_factory=list)
    num_preemptions: int = 0
    num_prefill_tokens: int = 0

    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.requests

    def add(self, request: Request, num_new: int) -> None:
        """Append ``request`` computing ``num_new`` tokens (before they are computed)."""
        self.requests.append((request, num_new))
        if not _is_decode(request, num_new):
            self.num_prefill_tokens += num_new


def _is_decode(request: Request, num_new: int) -> bool:
    """Whether ``num_new`` tokens of ``request`` (not yet computed) are one decode."""
    position = request.num_computed_tokens
    return (
        num_new == 1
        and position == request.num_tokens - 1
        and position >= request.num_prompt_tokens
    )
