"""Liveness of one engine child, as its client sees it: heartbeats and health checks.

The engine sends a `Heartbeat` every second from a task of its own, saying how long the
step under way has run; its client also sends a `HealthCheck` every second
(`HealthWatch.send_checks`) and the engine's main loop answers it between steps. The
engine is hung when it is silent for ``step_timeout`` seconds, when a step runs longer,
or when a health check stays unanswered that long while no step runs (its reader or its
loop is stuck while its heartbeats go on). Without a step timeout an unanswered check is
only reported (``/health`` answers 503).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from trio_llm.errors import EngineHungError
from trio_llm.messages import HealthCheck, Heartbeat

#: Seconds between the `HealthCheck` round trips through the engine's loop (at most; a
#: quarter of the step timeout when that is shorter).
HEALTH_CHECK_INTERVAL = 1.0

#: Without hang detection (no step timeout): seconds a health check may stay unanswered,
#: while no step runs, before the engine is reported unhealthy (``/health`` answers 503).
UNANSWERED_LIMIT = 60.0


class HealthWatch:
    """The deadlines of one engine channel's reader (times on trio's clock).

    Args:
        step_timeout: seconds of silence, of one step, or of an unanswered health check
            while no step runs, after which the engine is hung; None: no hang detection.
    """

    def __init__(self, step_timeout: float | None) -> None:
        self.step_timeout = step_timeout
        #: The last `HealthCheck` sent, and when (None once answered).
        self.seq = 0
        self.unanswered_since: float | None = None
        #: When the engine was last seen in or just after a step: an unanswered health
        #: check counts from then, since a step delays the answer.
        self.last_busy = -math.inf
        #: A health check has been unanswered for `UNANSWERED_LIMIT` (no hang detection).
        self.stalled = False
        #: The cancel scope of the reader's wait for the next message.
        self.receive_scope = trio.CancelScope()

    @property
    def timeout(self) -> float:
        """Seconds of silence (or of one step) after which the engine is hung."""
        return math.inf if self.step_timeout is None else self.step_timeout

    @property
    def unanswered_limit(self) -> float:
        """Seconds a health check may stay unanswered while no step runs."""
        return UNANSWERED_LIMIT if self.step_timeout is None else self.step_timeout

    def start(self) -> None:
        """A new child's channel: nothing is unanswered yet."""
        self.unanswered_since = None
        self.stalled = False

    def receive_deadline(self, heard: float) -> float:
        """When the wait for the next message, begun at ``heard``, must end."""
        deadline = heard + self.timeout
        if self.unanswered_since is not None and not self.stalled:
            since = max(self.unanswered_since, self.last_busy)
            deadline = min(deadline, since + self.unanswered_limit)
        # `send_checks` brings the deadline forward when it sends a check.
        return deadline

    def busy(self) -> None:
        """The engine is in or just after a step now."""
        self.last_busy = trio.current_time()

    def answered(self, seq: int) -> None:
        """A `HealthReply` arrived for check ``seq``."""
        if seq == self.seq:
            self.unanswered_since = None
            self.stalled = False

    def heartbeat(self, message: Heartbeat) -> str | None:
        """Take a `Heartbeat`; returns why the engine is hung (a step ran too long), or None."""
        if message.step_seconds > 0:
            self.busy()
        if message.step_seconds > self.timeout:
            return f"engine core hung: a step has run for {message.step_seconds:.1f} s"
        return None

    def silence(self, heard: float) -> str | None:
        """The wait begun at ``heard`` passed its deadline: why the engine is hung, or None
        when it is only reported (``stalled``: no hang detection)."""
        if trio.current_time() >= heard + self.timeout:
            return f"engine core hung: no heartbeat for {self.timeout:g} s"
        if self.step_timeout is None:
            self.stalled = True
            return None
        return (
            f"engine core hung: its loop left a health check unanswered for "
            f"{self.unanswered_limit:g} s while no step ran"
        )

    def stalled_error(self) -> EngineHungError:
        """What ``/health`` reports while ``stalled``."""
        return EngineHungError(
            f"the engine core has left a health check unanswered for "
            f"{UNANSWERED_LIMIT:g} s while no step ran"
        )

    async def send_checks(self, send: Callable[[HealthCheck], Awaitable[None]]) -> None:
        """Forever: every interval, a `HealthCheck` unless the last one is unanswered."""
        interval = min(HEALTH_CHECK_INTERVAL, self.unanswered_limit / 4)
        while True:
            await trio.sleep(interval)
            if self.unanswered_since is None:
                self.seq += 1
                self.unanswered_since = now = trio.current_time()
                scope = self.receive_scope
                scope.deadline = min(scope.deadline, now + self.unanswered_limit)
                await send(HealthCheck(self.seq))
