"""Who gives back a batch slot when requests wait for one (`slot_victims`).

When more requests are ready to run than the batch has free slots (``max_num_seqs``),
the waiting requests are served rank by rank, best first (ranks:
`trio_llm.engine.request_queue`). The requests of one rank get, in this order:

1. the free slots;
2. the slots of running requests of a worse rank, the worst first (the newest among
   equals). While interactive requests wait, a batch-lane request gives back its slot
   only while the batch lane holds more than its share of the batch
   (`SchedulerConfig.batch_lane_slots`): the lane is preempted down to that share, no
   further, and only as far as the waiting requests need;
3. max-min fair shares between the groups of that rank (`fair_shares`): a group holding
   more than its share gives back its newest requests, so a short request arriving
   behind one ``n=128`` request joins at the next step.

A rank whose requests do not all get a slot leaves none to worse ranks, and batch-lane
requests get none while an interactive request waits. With one rank for every request
(``fcfs``, no batch lane) only the fair shares act.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from trio_llm.engine.request import Request
from trio_llm.engine.request_queue import Rank


def fair_shares(demands: dict[str, int], capacity: int) -> dict[str, int]:
    """Max-min fair shares of ``capacity`` slots between groups (water-filling).

    Args:
        demands: slots each group could use (running plus waiting requests), > 0.
        capacity: slots to share (``max_num_seqs``).

    Returns:
        Each group's share: no group gets more than its demand, and no group's share can
        grow without shrinking a share that is not larger. Groups with equal demands get
        shares that differ by at most one (the earlier group, in ``demands`` order, gets
        the larger one).
    """
    shares = dict.fromkeys(demands, 0)
    left = capacity
    ordered = sorted(demands, key=demands.__getitem__)
    for index, group in enumerate(ordered):
        level = left // (len(ordered) - index)
        if demands[group] > level:
            # Every group from here on wants more than an equal split of what is left.
            for other in ordered[index:]:
                shares[other] = level
            left -= level * (len(ordered) - index)
            break
        shares[group] = demands[group]
        left -= demands[group]
    # What the integer division left over (fewer slots than groups that want more): one
    # each, in ``demands`` order, so ties go to the earlier groups.
    for group in [g for g in demands if shares[g] < demands[g]][: max(left, 0)]:
        shares[group] += 1
    return shares


def slot_victims(
    running: list[Request],
    ready: list[Request],
    num_running: Counter[str],
    *,
    max_num_seqs: int,
    rank: Callable[[Request], Rank],
    batch_lane_slots: int,
) -> list[Request]:
    """The running requests to preempt so that waiting ones get batch slots (module
    docstring), in the order to preempt them.

    Args:
        running: the running batch.
        ready: the waiting requests that could run (not waiting for a grammar), in line
            order (best rank first).
        num_running: running requests by group; its order (the order groups started
            running) breaks ties between equal shares.
        max_num_seqs: batch slots.
        rank: a request's rank (`RequestQueue.rank`).
        batch_lane_slots: slots the batch lane keeps while interactive requests wait.
    """
    free = max_num_seqs - len(running)
    if free >= len(ready):
        return []
    kept = list(running)
    victims: list[Request] = []
    interactive_waits = any(not request.batch for request in ready)
    for members in _runs_of_equal_rank(ready, rank):
        if interactive_waits and members[0].batch:
            break  # the batch lane waits while interactive requests do
        if free >= len(members):
            free -= len(members)
            continue
        level = rank(members[0])
        cap = batch_lane_slots if interactive_waits else None
        worse = _worse_ranked(kept, level, rank, cap)
        same = [request for request in kept if rank(request) == level]
        chosen, free, served = _rank_victims(same, members, free, worse, num_running)
        victims += chosen
        kept = [request for request in kept if request not in chosen]
        if not served:
            break  # worse ranks get no slot while this one lacks some
    return victims


def _runs_of_equal_rank(
    ready: list[Request], rank: Callable[[Request], Rank]
) -> Iterator[list[Request]]:
    """``ready`` (in rank order) cut into its runs of one rank each."""
    run: list[Request] = []
    for request in ready:
        if run and rank(request) != rank(run[0]):
            yield run
            run = []
        run.append(request)
    if run:
        yield run


def _worse_ranked(
    kept: list[Request], level: Rank, rank: Callable[[Request], Rank], cap: int | None
) -> list[Request]:
    """The running requests ranked below ``level`` that may give back their slot, the
    worst first (the newest among equals); batch-lane ones only down to ``cap`` of them
    (None: all)."""
    candidates = sorted(
        (request for request in kept if rank(request) > level),
        key=lambda request: (rank(request), request.arrival_index),
        reverse=True,
    )
    if cap is None:
        return candidates
    over = sum(request.batch for request in kept) - cap
    worse = []
    for request in candidates:
        if request.batch:
            if over <= 0:
                continue
            over -= 1
        worse.append(request)
    return worse


def _rank_victims(
    same: list[Request],
    waiting: list[Request],
    free: int,
    worse: list[Request],
    num_running: Counter[str],
) -> tuple[list[Request], int, bool]:
    """Slots for the ``waiting`` requests of one rank: the victims (of ``worse``, then
    of the rank's own groups above their fair share), the free slots left, and whether
    every waiting request gets a slot.

    Args:
        same: the running requests of that rank, in running order.
    """
    counts = Counter(request.group for request in same)
    order = [group for group in num_running if group in counts]
    order += [group for group in counts if group not in num_running]
    num_waiting = Counter(request.group for request in waiting)
    demands = {group: counts[group] + num_waiting[group] for group in (*order, *num_waiting)}
    shares = fair_shares(demands, len(same) + free + len(worse))
    wanted = sum(
        min(count, max(0, shares[group] - counts[group])) for group, count in num_waiting.items()
    )
    from_free = min(wanted, free)
    victims = worse[: wanted - from_free]
    need = wanted - from_free - len(victims)
    excess = {
        group: counts[group] - shares[group] for group in order if counts[group] > shares[group]
    }
    remaining = list(same)
    for _ in range(need):
        if not excess:
            break
        group = max(excess, key=excess.__getitem__)
        victim = next(r for r in reversed(remaining) if r.group == group)
        remaining.remove(victim)
        victims.append(victim)
        excess[group] -= 1
        if not excess[group]:
            del excess[group]
    return victims, free - from_free, wanted >= len(waiting)
