"""How requests rank, and the waiting line in that order (`RequestQueue`).

A request's *rank* is ``(lane, priority)``: every interactive request (lane 0) ranks
before every batch-lane request (lane 1, `Request.batch`), whatever the policy and the
priorities; within a lane, under ``--scheduling-policy priority``, a lower
`Request.priority` ranks first (vLLM's convention), and under ``fcfs`` priorities do not
count (the engine refuses a nonzero one). A lower rank is a *better* one.

The waiting line is ordered by rank, then:

- ``fcfs``: line order, as before ranks existed: a new request at the back of its lane,
  a preempted or resumed one at the front of it (it was first in line before).
- ``priority``: arrival (`Request.arrival_index`), as vLLM's priority queue: a preempted
  or resumed request goes back to its place by arrival.

The scheduler (`trio_llm.engine.scheduler`) admits waiting requests of the best rank
first, sharing batch slots fairly between the groups of one rank
(`trio_llm.engine.slot_shares`); its running batch is kept in rank order too, so the
token budget of a step goes to better-ranked requests first, and when a better-ranked
request finds no batch slot or KV blocks, a worse-ranked running one gives them back
(preempted). With one rank for every request (``fcfs``, no batch lane) all of this is
the plain first-come-first-served line.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, deque
from collections.abc import Callable, Iterator
from itertools import chain

from trio_llm.engine.request import Request

#: A request's rank: ``(lane, priority)``; lower ranks are served first.
Rank = tuple[int, int]


def rank_of(batch: bool, priority: int, *, by_priority: bool) -> Rank:
    """The rank of a request in the batch lane or not, of ``priority`` (counted only
    ``by_priority``: under the ``priority`` policy)."""
    return (int(batch), priority if by_priority else 0)


class RequestQueue:
    """The waiting requests of a scheduler, best rank first (module docstring).

    Args:
        policy: ``"fcfs"`` or ``"priority"`` (`trio_llm.config.SCHEDULING_POLICIES`).

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.by_priority = policy == "priority"
        #: fcfs: one line per lane, interactive then batch.
        self._lanes: tuple[deque[Request], deque[Request]] = (deque(), deque())
        #: priority: every waiting request, sorted by `_key`.
        self._sorted: list[Request] = []

    def rank(self, request: Request) -> Rank:
        """``(lane, priority)``: 0 for interactive and 1 for batch-lane requests, and the
        priority under the ``priority`` policy (0 under ``fcfs``)."""
        return rank_of(request.batch, request.priority, by_priority=self.by_priority)

    def _key(self, request: Request) -> tuple[int, int, int]:
        return (*self.rank(request), request.arrival_index)

    def next_ready(
        self,
        level: Rank,
        num_running: Counter[str],
        is_long: Callable[[int], bool],
        long_taken: bool,
    ) -> Request | None:
        """The waiting request of rank ``level`` (the best rank waiting) to admit next: of
        the group with the fewest running requests (``num_running``), the first in line.
        Requests waiting for their grammar are passed over, and long ones (``is_long`` of
        their token count) while ``long_taken`` (the long prefill places of the step are
        taken)."""
        best: Request | None = None
        best_count = 0
        for request in self:
            if request.waits_for_grammar:
                continue
            if self.rank(request) != level:
                break  # the line is in rank order: worse ranks from here on
            if long_taken and is_long(request.num_tokens):
                continue
            count = num_running[request.group]
            if best is None or count < best_count:
                best, best_count = request, count
                if count == 0:
                    break
        return best

    def append(self, request: Request) -> None:
        """Queue a new request: behind every waiting request of its rank."""
        if self.by_priority:
            insort(self._sorted, request, key=self._key)
        else:
            self._lanes[request.batch].append(request)

    def prepend(self, request: Request) -> None:
        """Put back a preempted or resumed request: ``fcfs``, at the front of its lane;
        ``priority``, at its place by arrival."""
        if self.by_priority:
            insort(self._sorted, request, key=self._key)
        else:
            self._lanes[request.batch].appendleft(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out of the line.

        Raises:
            ValueError: it is not waiting here.
        """
        if self.by_priority:
            self._sorted.remove(request)
        else:
            self._lanes[request.batch].remove(request)

    def __iter__(self) -> Iterator[Request]:
        if self.by_priority:
            return iter(self._sorted)
        return chain(*self._lanes)

    def __len__(self) -> int:
        return len(self._sorted) + len(self._lanes[0]) + len(self._lanes[1])

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, index: int) -> Request:
        """The request at ``index`` in line (0: the next one)."""
        if self.by_priority:
            return self._sorted[index]
        return list(self)[index]
