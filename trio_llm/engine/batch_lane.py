"""How much of a step the batch lane may take while interactive requests are served.

The batch lane (`Request.batch`: lines of the in-process batch runner) ranks below every
interactive request (`trio_llm.engine.request_queue`), so an interactive request joins the
next step. What it still waits for is the step in progress and the batch work in its own
steps: a step of 128 batch decodes takes several times one of a few requests on a CPU.
So while interactive requests are served, the batch lane is held to small steps:

- in a step where an interactive request waits to join, the batch lane computes nothing
  (its requests keep their KV blocks and slots, and go on in the next step);
- while an interactive request runs, and for `QUIET_SECONDS` after the last one was seen
  (interactive requests tend to come one after another), the batch lane computes at most
  ``SchedulerConfig.batch_lane_slots`` tokens a step (``--max-batch-share`` of
  ``--max-num-seqs``);
- otherwise it may fill the step.

The steps then stay about as short as without the batch, at the price of the batch's
throughput while interactive requests are served (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds after the last interactive request was seen during which the batch lane is
#: still held to small steps.
QUIET_SECONDS = 2.0


class BatchLaneThrottle:
    """The batch lane's token budget of each step (see the module docstring).

    Args:
        lane_tokens: the batch lane's tokens a step while interactive requests are served
            (`SchedulerConfig.batch_lane_slots`).
        clock: seconds (monotonic); tests pass their own.
    """

    def __init__(self, lane_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lane_tokens = lane_tokens
        self.clock = clock
        self._last_interactive: float | None = None

    def budget(self, *, interactive_waiting: bool, interactive_running: bool) -> int | None:
        """The batch lane's tokens for the next step: 0, `lane_tokens`, or None (no limit
        but the step's)."""
        now = self.clock()
        if interactive_waiting or interactive_running:
            self._last_interactive = now
        if interactive_waiting:
            return 0
        recent = self._last_interactive is not None and now - self._last_interactive < QUIET_SECONDS
        return self.lane_tokens if recent else None
