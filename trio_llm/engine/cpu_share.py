"""How many torch threads the engine's steps use, from the CPU other processes take.

torch splits each product evenly between its OpenMP threads and waits for the slowest.
When another process takes a core, the engine thread on that core gets part of it and
every product waits for it, while the other thread spins or sleeps: beside a one-core hog
the engine ran 2.6-3x slower on 2 cores, and each of two engines 3-4.4x slower, where a
fair share costs 2x (bench/contention.py). With one thread fewer per core taken, nothing
waits for a descheduled thread.

`CpuShare` measures, over windows of `WINDOW_SECONDS`, the CPU time the machine spent
busy (``/proc/stat``) minus the time this process spent (``os.times``): the cores other
processes took. It recommends ``cores - others`` threads (at least 1, at most the
configured count), with a margin either way so that it does not flap. The engine loop
asks it before each step (`trio_llm.engine.loop`); a ``--num-threads`` given on the
command line turns it off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Seconds over which the other processes' CPU use is measured.
WINDOW_SECONDS = 1.0

#: Others must take at least this much more (less) than a whole number of cores for the
#: recommendation to drop (rise) by one thread.
MARGIN = 0.15


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq; not
    idle, I/O wait or time stolen by a hypervisor), or None where ``/proc/stat`` is
    unreadable."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    times = os.times()
    return times.user + times.system


class CpuShare:
    """Recommends the engine's thread count (see the module docstring).

    Args:
        max_threads: the most threads to use (the configured count).
        cores: CPUs this process may run on (default: its affinity mask).
        busy, own, clock: sources of machine busy seconds, own CPU seconds and monotonic
            time (replaceable in tests).
    """

    def __init__(
        self,
        max_threads: int,
        cores: int | None = None,
        busy: Callable[[], float | None] = machine_busy_seconds,
        own: Callable[[], float] = own_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or len(os.sched_getaffinity(0))
        self._busy, self._own, self._clock = busy, own, clock
        #: The current recommendation.
        self.threads = self.max_threads
        #: Cores the other processes took over the last full window (None before one).
        self.others: float | None = None
        self._start = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(), self._own()

    def recommend(self) -> int:
        """The thread count for the next step; updated once a window has passed."""
        now, busy, own = sample = self._sample()
        start_time, start_busy, start_own = self._start
        elapsed = now - start_time
        if elapsed < WINDOW_SECONDS:
            return self.threads
        self._start = sample
        if busy is None or start_busy is None:
            return self.threads
        others = max(0.0, (busy - start_busy) - (own - start_own)) / elapsed
        self.others = others
        # Threads that would each get a whole core: cores - others, rounded with a margin
        # against the current count.
        free = self.cores - others
        if free < self.threads - MARGIN - 0.5 or free > self.threads + MARGIN + 0.5:
            self.threads = round(free)
        self.threads = max(1, min(self.max_threads, self.threads))
        return self.threads
