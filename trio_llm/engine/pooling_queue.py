"""The queue of waiting embedding inputs, and how a pooling step's batch is taken from it.

The steps are shared fairly between API requests: the inputs of one API request share a
*group* (`AddRequest.group`), and each step is led by the next group in turn (groups take
their turn in the order they arrived; the group that led goes behind every group waiting
then). The leader's inputs come first, packed by similar length; the room they leave is
filled with other groups' inputs of the most similar lengths, none much longer than the
leader's (`PoolingQueue.take_batch`). So one request of 2,048 inputs leads one step in
each round and cannot keep a one-input request waiting for more than about a step (the
one running when it arrives, then its own, short one), and no input waits for ever.

Groups rank as generating requests do (`trio_llm.engine.request_queue`: interactive
before the batch lane, then priority under the ``priority`` policy): a step takes the
inputs of the best-ranked groups waiting only, in the same turns between them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from trio_llm.engine.request_queue import Rank

#: A pooling step picks its leader's inputs among the group's oldest ``BATCH_WINDOW *
#: max_num_seqs``, and the inputs that fill the rest of the batch among as many of the other
#: groups' (by similar length; `PoolingQueue.take_batch`).
BATCH_WINDOW = 4

#: Other groups' inputs fill a step's room only up to this many times the length of its
#: leader's longest input, so that a short request's step stays short (a one-input
#: request is not padded to the length of a large request beside it).
FILL_LENGTH_FACTOR = 2


@dataclass
class Waiting:
    """One waiting input: its request id, token ids, arrival (``time.monotonic``), group,
    rank (the same for every input of a group) and, for a cross-encoder's pair, where its
    second text starts (`SamplingParams.second_text_start`)."""

    request_id: str
    token_ids: list[int]
    arrival: float
    group: str
    rank: Rank = (0, 0)
    second_text_start: int | None = None


def _interleave(queues: Iterable[deque[Waiting]], limit: int) -> list[Waiting]:
    """Up to ``limit`` waiting inputs, taken round-robin from ``queues`` (the first of
    each queue, then the second of each ...), so that no queue fills them alone."""
    out: list[Waiting] = []
    iterators = [iter(queue) for queue in islice(queues, limit)]
    while iterators and len(out) < limit:
        alive = []
        for iterator in iterators:
            item = next(iterator, None)
            if item is not None:
                out.append(item)
                alive.append(iterator)
                if len(out) == limit:
                    break
        iterators = alive
    return out


class PoolingQueue:
    """Waiting inputs by group, in turn order (module docstring)."""

    def __init__(self) -> None:
        #: Waiting inputs by group (a request without a group is one of its own), in
        #: turn order: the next step's leader first (see `take_batch`).
        self.groups: dict[str, deque[Waiting]] = {}
        self._group_of: dict[str, str] = {}  # request id -> its group
        #: Inputs waiting, over all groups.
        self.num_waiting = 0
        self._last_leader: str | None = None

    def add(self, waiting: Waiting) -> None:
        """Queue an input behind the others of its group."""
        self.groups.setdefault(waiting.group, deque()).append(waiting)
        self._group_of[waiting.request_id] = waiting.group
        self.num_waiting += 1

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests if they still wait (unknown ids are ignored)."""
        gone: dict[str, set[str]] = {}
        for request_id in request_ids:
            group = self._group_of.pop(request_id, None)
            if group is not None:
                gone.setdefault(group, set()).add(request_id)
        for group, ids in gone.items():
            self._remove(group, lambda r, ids=ids: r.request_id in ids)

    def _remove(self, group: str, drop: Callable[[Waiting], bool]) -> None:
        """Drop the inputs of ``group`` for which ``drop`` is true (and the group once
        it has none left)."""
        queue = self.groups[group]
        kept = deque(r for r in queue if not drop(r))
        self.num_waiting -= len(queue) - len(kept)
        if kept:
            self.groups[group] = kept
        else:
            del self.groups[group]
            if group == self._last_leader:
                self._last_leader = None

    def take_batch(self, max_rows: int, budget: int) -> list[Waiting]:
        """The next batch, within ``max_rows`` requests and ``budget`` padded tokens
        (each row is padded to the longest, so similar lengths waste the least):

        1. The leader is the first group in turn order, after the previous step's leader
           went behind every group waiting now. Its oldest input always goes, then its
           inputs closest in length to that one (among its oldest `BATCH_WINDOW` times
           ``max_rows``) while they fit.
        2. The room left goes to the other groups' inputs closest in length to the
           leader's oldest, among as many of theirs taken round-robin from the groups in
           turn order (so the first group cannot fill it alone), none longer than
           `FILL_LENGTH_FACTOR` times the leader's longest.

        Each group leads once per round, so a group waits for at most one step per group
        ahead of it, and every input is taken in the end."""
        if not self.groups:
            return []
        last = self._last_leader
        if last is not None and len(self.groups) > 1:
            self.groups[last] = self.groups.pop(last)  # behind everyone waiting now
        window = BATCH_WINDOW * max_rows
        best = min(queue[0].rank for queue in self.groups.values())
        turns = [(g, queue) for g, queue in self.groups.items() if queue[0].rank == best]
        leader, queue = turns[0]
        self._last_leader = leader
        own = list(islice(queue, window))
        batch = [own[0]]
        mine = len(own[0].token_ids)
        longest = _fill(batch, own[1:], mine, mine, budget, max_rows, budget)
        others = _interleave((queue for _, queue in turns[1:]), window)
        _fill(batch, others, mine, longest, FILL_LENGTH_FACTOR * longest, max_rows, budget)
        taken: dict[str, set[int]] = {}
        for request in batch:
            taken.setdefault(request.group, set()).add(id(request))
            del self._group_of[request.request_id]
        for group, ids in taken.items():
            self._remove(group, lambda r, ids=ids: id(r) in ids)
        return batch


def _fill(
    batch: list[Waiting],
    candidates: list[Waiting],
    mine: int,
    longest: int,
    cap: int,
    max_rows: int,
    budget: int,
) -> int:
    """Append to ``batch`` the ``candidates`` closest in length to ``mine`` while they fit
    (``max_rows`` rows, ``budget`` padded tokens, none making the longest row longer
    than ``cap``); ``longest`` is the batch's longest row. Returns the new longest."""
    candidates.sort(key=lambda r: (abs(len(r.token_ids) - mine), len(r.token_ids)))
    for request in candidates:
        if len(batch) == max_rows or longest * (len(batch) + 1) > budget:
            break  # nothing more can fit
        grown = max(longest, len(request.token_ids))
        if grown <= cap and grown * (len(batch) + 1) <= budget:
            batch.append(request)
            longest = grown
    return longest
