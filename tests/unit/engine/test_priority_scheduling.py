"""Ranks in the scheduler (issue 34): vLLM's priority policy and the batch lane.

The scheduler is driven alone, as in test_scheduler.py: each step is scheduled, the model
is pretended to have run, and every completed sequence samples token 7.
"""

from __future__ import annotations

import itertools
import random

import pytest

from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.config import SchedulerConfig, engine_config
from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.pooling_queue import PoolingQueue, Waiting
from trio_llm.engine.request import Request, RequestStatus
from trio_llm.engine.request_queue import RequestQueue
from trio_llm.engine.scheduler import ScheduledBatch, Scheduler
from trio_llm.messages import SamplingParams

EOS = 2


def _scheduler(
    policy: str = "fcfs",
    *,
    max_num_seqs: int = 4,
    budget: int = 64,
    num_blocks: int = 256,
    block_size: int = 4,
    share: float = 0.5,
    seconds_per_step: float = 0.5,
) -> Scheduler:
    """A scheduler whose clock moves ``seconds_per_step`` at each `Scheduler.schedule`
    (its only reader): the batch lane's quiet time after interactive requests
    (`trio_llm.engine.batch_lane.QUIET_SECONDS`) is then counted in steps."""
    ticks = itertools.count()
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        scheduling_policy=policy,
        max_batch_share=share,
    )
    return Scheduler(
        config,
        BlockManager(num_blocks, block_size),
        1000,
        frozenset({EOS}),
        clock=lambda: next(ticks) * seconds_per_step,
    )


def _request(
    rid: str,
    prompt_len: int = 2,
    *,
    priority: int = 0,
    batch: bool = False,
    group: str | None = None,
    max_tokens: int = 100,
) -> Request:
    prompt = list(range(10, 10 + prompt_len))
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, prompt, params, group, priority=priority, batch=batch)


def _run(scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
    """Pretend the model ran ``batch``; every completed sequence samples token 7."""
    sampled = {
        r.request_id: 7 for r, n in batch.requests if r.num_computed_tokens + n == r.num_tokens
    }
    return scheduler.update(batch, sampled)


def _step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    _run(scheduler, batch)
    return batch


def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def _scheduled(batch: ScheduledBatch) -> list[str]:
    return [r.request_id for r, _ in batch.requests]


# ------------------------------------------------------------------ the waiting line


def test_the_priority_line_is_ordered_by_priority_then_arrival() -> None:
    queue = RequestQueue("priority")
    for rid, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        queue.append(_request(rid, priority=priority))
    assert _ids(queue) == ["d", "b", "e", "a", "c"]
    first = queue[0]
    queue.remove(first)
    queue.prepend(first)  # preempted: back to its place by arrival, not the front
    assert _ids(queue) == ["d", "b", "e", "a", "c"]
    late_better = _request("f", priority=0)
    queue.prepend(late_better)
    assert _ids(queue) == ["d", "b", "e", "f", "a", "c"]


def test_the_fcfs_line_ignores_priority_and_puts_the_batch_lane_last() -> None:
    queue = RequestQueue("fcfs")
    queue.append(_request("batch1", batch=True, priority=-5))
    queue.append(_request("a", priority=3))
    queue.append(_request("b"))
    queue.append(_request("batch2", batch=True))
    assert _ids(queue) == ["a", "b", "batch1", "batch2"]
    back = _request("c")
    queue.prepend(back)  # preempted or resumed: the front of its lane
    assert _ids(queue) == ["c", "a", "b", "batch1", "batch2"]
    assert len(queue) == 5 and queue[3].request_id == "batch1"
    with pytest.raises(ValueError):
        RequestQueue("lottery")


def test_the_batch_lane_ranks_after_every_interactive_priority() -> None:
    queue = RequestQueue("priority")
    queue.append(_request("batch", batch=True, priority=-100))
    queue.append(_request("slow", priority=100))
    assert _ids(queue) == ["slow", "batch"]
    assert queue.rank(queue[0]) < queue.rank(queue[1])


# ------------------------------------------------------------------ priority policy


def test_a_better_priority_arrival_preempts_the_worst_running_request_when_the_batch_is_full() -> (
    None
):
    scheduler = _scheduler("priority", max_num_seqs=3)
    scheduler.add(_request("mid", priority=1))
    scheduler.add(_request("worst_old", priority=5))
    scheduler.add(_request("worst_new", priority=5))
    _step(scheduler)
    _step(scheduler)
    assert len(scheduler.running) == 3
    scheduler.add(_request("urgent", priority=0))
    batch = _step(scheduler)
    # The worst priority gives its slot back, the newest among equals.
    assert batch.num_preemptions == 1
    assert "urgent" in _scheduled(batch)
    assert _ids(scheduler.running) == ["urgent", "mid", "worst_old"]
    assert _ids(scheduler.waiting) == ["worst_new"]
    preempted = scheduler.waiting[0]
    assert preempted.status is RequestStatus.WAITING and preempted.num_computed_tokens == 0
    # It waits while the batch is full of better requests: nothing more is preempted.
    for _ in range(3):
        assert _step(scheduler).num_preemptions == 0


def test_a_worse_or_equal_priority_arrival_preempts_no_one() -> None:
    scheduler = _scheduler("priority", max_num_seqs=2)
    scheduler.add(_request("a", priority=3))
    scheduler.add(_request("b", priority=3))
    _step(scheduler)
    scheduler.add(_request("same", priority=3))
    scheduler.add(_request("worse", priority=4))
    for _ in range(3):
        batch = _step(scheduler)
        assert batch.num_preemptions == 0
        assert _scheduled(batch) == ["a", "b"]
    assert _ids(scheduler.waiting) == ["same", "worse"]


def test_a_better_priority_request_takes_the_kv_blocks_of_a_worse_running_one() -> None:
    # 4 blocks of 4 tokens, slots to spare: "low" holds 3 blocks, 1 is free.
    scheduler = _scheduler("priority", max_num_seqs=4, num_blocks=4)
    scheduler.add(_request("low", prompt_len=10, priority=9))
    _step(scheduler)
    scheduler.add(_request("high", prompt_len=8, priority=0))  # needs 2 blocks
    batch = scheduler.schedule()
    assert batch.num_preemptions == 1
    # "low" was scheduled for its decode, then taken out of the batch again.
    assert [(r.request_id, n) for r, n in batch.requests] == [("high", 8)]
    assert batch.num_prefill_tokens == 8
    _run(scheduler, batch)
    assert _ids(scheduler.running) == ["high"] and _ids(scheduler.waiting) == ["low"]


def test_under_fcfs_a_waiting_request_without_blocks_preempts_no_one() -> None:
    scheduler = _scheduler("fcfs", max_num_seqs=4, num_blocks=4)
    scheduler.add(_request("first", prompt_len=10))
    _step(scheduler)
    scheduler.add(_request("second", prompt_len=8))
    batch = _step(scheduler)
    assert batch.num_preemptions == 0 and _scheduled(batch) == ["first"]


def test_equal_priorities_keep_fair_shares_between_groups() -> None:
    scheduler = _scheduler("priority", max_num_seqs=8)
    for i in range(8):
        scheduler.add(_request(f"big{i}", priority=2, group="big"))
    _step(scheduler)
    scheduler.add(_request("small", priority=2, group="small"))
    batch = _step(scheduler)
    assert "small" in _scheduled(batch)
    assert _ids(scheduler.waiting) == ["big7"]


def test_the_token_budget_goes_to_the_better_priority_first() -> None:
    scheduler = _scheduler("priority", max_num_seqs=4, budget=8)
    scheduler.add(_request("low", prompt_len=40, priority=5))
    _step(scheduler)  # "low" prefills its first 8 tokens
    scheduler.add(_request("high", prompt_len=6, priority=0))
    batch = _step(scheduler)
    # The newcomer joins before "low" takes its next chunk; "low" gets what is left.
    assert [(r.request_id, n) for r, n in batch.requests] == [("high", 6), ("low", 2)]
    batch = _step(scheduler)
    assert [(r.request_id, n) for r, n in batch.requests] == [("high", 1), ("low", 7)]
    assert _ids(scheduler.running) == ["high", "low"]


# ------------------------------------------------------------------ the batch lane


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_batch_lane_request_never_runs_ahead_of_an_interactive_one(policy: str) -> None:
    scheduler = _scheduler(policy, max_num_seqs=2, budget=16)
    priority = -10 if policy == "priority" else 0  # a better priority does not help
    for i in range(4):
        scheduler.add(_request(f"batch{i}", prompt_len=6, batch=True, priority=priority))
    for i in range(4):
        scheduler.add(_request(f"chat{i}", prompt_len=6, max_tokens=3))
    seen_batch = False
    for _ in range(30):
        batch = scheduler.schedule()
        lanes = [r.batch for r, _ in batch.requests]
        # Interactive requests first in every step's budget ...
        assert lanes == sorted(lanes)
        waiting_chat = [r for r in scheduler.waiting if not r.batch]
        newly_started = [r for r, _ in batch.requests if r.batch and r.num_computed_tokens == 0]
        # ... and no batch request starts while an interactive one still waits.
        assert not (waiting_chat and newly_started)
        seen_batch |= any(lanes)
        _run(scheduler, batch)
    assert seen_batch
    assert not any(r.request_id.startswith("chat") for r in scheduler.running)


def test_an_interactive_arrival_has_its_step_then_the_batch_lane_takes_its_share() -> None:
    scheduler = _scheduler(max_num_seqs=4, budget=10)  # share 0.5: 2 batch tokens a step
    scheduler.add(_request("batch", prompt_len=30, batch=True))
    assert _step(scheduler).requests[0][1] == 10  # alone: it takes the whole budget
    scheduler.add(_request("chat", prompt_len=7))
    batch = _step(scheduler)
    # The interactive request's prefill step is its own: the batch lane sits it out.
    assert [(r.request_id, n) for r, n in batch.requests] == [("chat", 7)]
    batch = _step(scheduler)
    assert [(r.request_id, n) for r, n in batch.requests] == [("chat", 1), ("batch", 2)]
    scheduler.abort(["chat"])
    # Until QUIET_SECONDS (2 s: 4 steps of 0.5 s here) after the last step that saw an
    # interactive request, the lane keeps to its share; then it takes the whole budget.
    assert [_step(scheduler).requests[0][1] for _ in range(4)] == [2, 2, 2, 10]


def test_the_batch_share_is_preempted_down_to_while_interactive_requests_wait() -> None:
    # 8 slots, share 0.5: the batch lane keeps 4 while interactive requests wait.
    scheduler = _scheduler(max_num_seqs=8, share=0.5)
    for i in range(8):
        scheduler.add(_request(f"batch{i}", batch=True))
    _step(scheduler)
    assert len(scheduler.running) == 8  # nothing interactive waits: the lane fills it all

    scheduler.add(_request("chat0"))
    batch = _step(scheduler)
    assert batch.num_preemptions == 1  # only the slot the one newcomer needs
    assert _scheduled(batch) == ["chat0"]  # the batch lane sits its step out
    assert _ids(scheduler.waiting) == ["batch7"]

    for i in range(1, 7):
        scheduler.add(_request(f"chat{i}"))
    batch = _step(scheduler)
    running_batch = [r for r in scheduler.running if r.batch]
    assert len(running_batch) == 4  # down to the share, the newest went first
    assert _ids(running_batch) == ["batch0", "batch1", "batch2", "batch3"]
    assert sum(not r.batch for r in scheduler.running) == 4
    assert len([r for r in scheduler.waiting if not r.batch]) == 3
    # While interactive requests wait, the share holds: nothing more is preempted.
    for _ in range(3):
        assert _step(scheduler).num_preemptions == 0
        assert sum(r.batch for r in scheduler.running) == 4

    # With no interactive request left (and QUIET_SECONDS gone: 4 steps of 0.5 s), the
    # batch lane fills the engine again.
    scheduler.abort([f"chat{i}" for i in range(7)])
    for _ in range(5):
        _step(scheduler)
    assert _ids(scheduler.running) == [f"batch{i}" for i in range(8)]


def test_the_batch_share_rounds_up() -> None:
    assert SchedulerConfig(max_num_seqs=10, max_batch_share=0.3).batch_lane_slots == 3
    assert SchedulerConfig(max_num_seqs=10, max_batch_share=0.25).batch_lane_slots == 3
    assert SchedulerConfig(max_num_seqs=3, max_batch_share=0.1).batch_lane_slots == 1
    assert SchedulerConfig(max_num_seqs=128).batch_lane_slots == 4  # the default, 1/32
    with pytest.raises(ValueError, match="max_batch_share"):
        SchedulerConfig(max_batch_share=0.0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lottery")


def test_an_interactive_request_takes_kv_blocks_from_the_batch_lane() -> None:
    scheduler = _scheduler("fcfs", max_num_seqs=4, num_blocks=4)
    scheduler.add(_request("batch", prompt_len=10, batch=True))
    _step(scheduler)
    scheduler.add(_request("chat", prompt_len=8))
    batch = _step(scheduler)
    assert batch.num_preemptions == 1 and _scheduled(batch) == ["chat"]
    assert _ids(scheduler.waiting) == ["batch"]
    # The batch request waits for blocks; it preempts no interactive one.
    for _ in range(2):
        assert _step(scheduler).num_preemptions == 0


def test_priorities_rank_within_the_batch_lane() -> None:
    scheduler = _scheduler("priority", max_num_seqs=2)
    scheduler.add(_request("b_low", batch=True, priority=5))
    scheduler.add(_request("b_mid", batch=True, priority=3))
    _step(scheduler)
    scheduler.add(_request("b_high", batch=True, priority=0))
    batch = _step(scheduler)
    assert batch.num_preemptions == 1 and "b_high" in _scheduled(batch)
    assert _ids(scheduler.waiting) == ["b_low"]


# ------------------------------------------------------------------ embeddings


def test_a_pooling_step_takes_the_best_ranked_groups_only() -> None:
    queue = PoolingQueue()
    queue.add(Waiting("batch0", [1, 2, 3], 0.0, "b", rank=(1, 0)))
    queue.add(Waiting("batch1", [1, 2, 3], 0.0, "b", rank=(1, 0)))
    queue.add(Waiting("low", [1, 2, 3], 0.0, "low", rank=(0, 5)))
    queue.add(Waiting("chat0", [4, 5, 6], 0.0, "c0"))
    queue.add(Waiting("chat1", [4, 5, 6], 0.0, "c1"))
    # The two rank (0, 0) groups share the step; nothing of a worse rank rides along.
    assert sorted(_ids(queue.take_batch(8, 1000))) == ["chat0", "chat1"]
    assert _ids(queue.take_batch(8, 1000)) == ["low"]
    assert sorted(_ids(queue.take_batch(8, 1000))) == ["batch0", "batch1"]


# ------------------------------------------------------------------ the flags


def test_the_serve_flags_set_the_policy_and_the_share(capsys: pytest.CaptureFixture) -> None:
    def scheduler(*flags: str) -> SchedulerConfig:
        return config_from_args(build_parser().parse_args(["serve", *flags])).engine.scheduler

    assert scheduler() == SchedulerConfig()
    chosen = scheduler("--scheduling-policy", "priority", "--max-batch-share", "0.25")
    assert (chosen.scheduling_policy, chosen.max_batch_share) == ("priority", 0.25)
    for flags in (["--scheduling-policy", "lottery"], ["--max-batch-share", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *flags])
    assert "--max-batch-share" in capsys.readouterr().err
    assert engine_config(scheduling_policy="priority").scheduler.scheduling_policy == "priority"


# ------------------------------------------------------------------ random workloads


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_keep_the_rank_rules(policy: str, seed: int) -> None:
    """Arrivals of both lanes and (under ``priority``) random priorities, groups, long
    prompts and aborts, on a small cache: after every step the running batch is in rank
    order, a full batch leaves no interactive request waiting behind more than the batch
    lane's share, nor behind a worse priority of its lane; no batch-lane request starts
    while an interactive one waits; and everything finishes with every block free."""
    rng = random.Random(seed)
    scheduler = _scheduler(policy, max_num_seqs=6, budget=24, num_blocks=40, share=0.34)
    cap = scheduler.config.batch_lane_slots
    names = iter(range(10_000))
    for step in range(400):
        if step < 250 and rng.random() < 0.4:
            group = f"g{next(names)}"
            for _ in range(rng.choice([1, 1, 1, 3])):
                scheduler.add(
                    _request(
                        f"r{next(names)}",
                        prompt_len=rng.choice([2, 5, 11, 30]),
                        priority=rng.randint(-2, 2) if policy == "priority" else 0,
                        batch=rng.random() < 0.4,
                        group=group,
                        max_tokens=rng.randint(1, 12),
                    )
                )
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort([rng.choice(scheduler.running).request_id])
        batch = scheduler.schedule()
        ranks = [scheduler.rank(r) for r in scheduler.running]
        assert ranks == sorted(ranks)
        ready = [r for r in scheduler.waiting if not r.waits_for_grammar]
        waiting_chat = [r for r in ready if not r.batch]
        started = [r for r, _ in batch.requests if r.batch and r.num_computed_tokens == 0]
        assert not (waiting_chat and started)
        if waiting_chat and len(scheduler.running) == scheduler.config.max_num_seqs:
            assert sum(r.batch for r in scheduler.running) <= cap
            best = min(scheduler.rank(r) for r in waiting_chat)
            assert all(scheduler.rank(r) <= best for r in scheduler.running if not r.batch)
        _run(scheduler, batch)
    assert scheduler.num_unfinished == 0
    assert scheduler.block_manager.num_free_blocks == 40
