"""Continuous-batching policy: budgets, chunked prefill, joining, finishing, preemption."""

from __future__ import annotations

from trio_llm.config import SchedulerConfig
from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.request import Request, RequestStatus
from trio_llm.engine.scheduler import Scheduler, fair_shares
from trio_llm.messages import SamplingParams

EOS = 2


def _scheduler(
    *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        BlockManager(num_blocks, block_size),
        max_model_len=1000,
        eos_token_ids=frozenset({EOS}),
    )


def _request(rid: str, prompt_len: int, max_tokens: int = 100, **params: object) -> Request:
    return Request(
        rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params)
    )


def _step(scheduler: Scheduler, token: int = 7) -> tuple[list[tuple[str, int]], list[Request]]:
    """Schedule, pretend the model ran, sample ``token`` for every completed sequence."""
    batch = scheduler.schedule()
    sampled = {
        r.request_id: token for r, n in batch.requests if r.num_computed_tokens + n == r.num_tokens
    }
    finished = scheduler.update(batch, sampled)
    return [(r.request_id, n) for r, n in batch.requests], finished


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    scheduler = _scheduler(budget=10)
    scheduler.add(_request("a", 25))
    assert _step(scheduler)[0] == [("a", 10)]
    assert _step(scheduler)[0] == [("a", 10)]
    assert _step(scheduler)[0] == [("a", 5)]  # last chunk samples the first token
    assert _step(scheduler)[0] == [("a", 1)]  # decode
    assert scheduler.running[0].num_output_tokens == 2


def test_decodes_come_first_and_new_requests_fill_the_rest_of_the_budget() -> None:
    scheduler = _scheduler(budget=8)
    scheduler.add(_request("a", 3))
    assert _step(scheduler)[0] == [("a", 3)]
    scheduler.add(_request("b", 20))
    scheduler.add(_request("c", 2))
    # a decodes (1 token), b takes the remaining 7 as its first chunk; c waits for budget.
    assert _step(scheduler)[0] == [("a", 1), ("b", 7)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_a_request_joins_the_running_batch_at_the_next_step() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 4))
    scheduler.add(_request("b", 4))
    _step(scheduler)
    _step(scheduler)
    scheduler.add(_request("c", 4))
    scheduled, _ = _step(scheduler)
    assert scheduled == [("a", 1), ("b", 1), ("c", 4)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(_request(name, 2))
    scheduled, _ = _step(scheduler)
    assert [rid for rid, _ in scheduled] == ["a", "b"]
    assert len(scheduler.running) == 2
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_finished_requests_leave_at_once_and_free_their_blocks() -> None:
    scheduler = _scheduler(num_blocks=8)
    scheduler.add(_request("eos", 3))
    scheduler.add(_request("len", 3, max_tokens=2))
    scheduler.add(_request("stop", 3, stop_token_ids=(9,)))
    free_before = scheduler.block_manager.num_free_blocks

    batch = scheduler.schedule()
    finished = scheduler.update(batch, {"eos": EOS, "len": 5, "stop": 9})
    assert {r.request_id: r.finish_reason for r in finished} == {"eos": "stop", "stop": "stop"}
    assert [r.request_id for r in scheduler.running] == ["len"]

    _, finished = _step(scheduler, token=5)
    assert [(r.request_id, r.finish_reason) for r in finished] == [("len", "length")]
    assert scheduler.running == []
    assert scheduler.block_manager.num_free_blocks == free_before
    assert scheduler.num_unfinished == 0


def test_ignore_eos_keeps_generating() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 2, max_tokens=3, ignore_eos=True))
    finished = []
    for _ in range(3):
        finished += _step(scheduler, token=EOS)[1]
    assert [(r.request_id, r.finish_reason, r.num_output_tokens) for r in finished] == [
        ("a", "length", 3)
    ]


def test_the_newest_request_is_preempted_when_blocks_run_out_and_recomputed_later() -> None:
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens take 2 blocks each.
    scheduler = _scheduler(num_blocks=4, block_size=2)
    scheduler.add(_request("old", 3))
    scheduler.add(_request("new", 3))
    _step(scheduler)  # both prefilled: 4 tokens in the sequence each, 3 computed
    _step(scheduler)  # both decode their 4th token: still 2 blocks each
    assert scheduler.block_manager.num_free_blocks == 0

    batch = scheduler.schedule()  # "old" needs a 3rd block for its 5th token
    assert batch.num_preemptions == 1
    assert [(r.request_id, n) for r, n in batch.requests] == [("old", 1)]
    new = scheduler.waiting[0]
    assert new.request_id == "new"
    assert new.status is RequestStatus.WAITING
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert new.num_output_tokens == 2  # its outputs are kept and recomputed
    scheduler.update(batch, {"old": 7})

    scheduler.abort(["old"])
    scheduled, _ = _step(scheduler)
    assert scheduled == [("new", 5)]  # prompt + both outputs recomputed in one chunk


def test_abort_removes_waiting_and_running_requests_and_frees_blocks() -> None:
    scheduler = _scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add(_request("run", 3))
    scheduler.add(_request("wait", 3))
    _step(scheduler)
    aborted = scheduler.abort(["run", "wait", "unknown"])
    assert sorted(r.request_id for r in aborted) == ["run", "wait"]
    assert scheduler.running == [] and not scheduler.waiting
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.schedule().is_empty()


def test_a_cached_prefix_is_not_recomputed() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        BlockManager(64, 4, enable_prefix_caching=True),
        max_model_len=1000,
        eos_token_ids=frozenset({EOS}),
    )
    scheduler.add(_request("a", 10, max_tokens=1))
    assert _step(scheduler)[0] == [("a", 10)]
    scheduler.add(_request("b", 11, max_tokens=1))  # same first 10 tokens, 8 of them cached
    assert _step(scheduler)[0] == [("b", 3)]
    scheduler.add(_request("c", 8, max_tokens=1))  # fully cached: the last block is recomputed
    assert _step(scheduler)[0] == [("c", 4)]


# ------------------------------------------------------------------ fairness (issue 14)


def _grouped(rid: str, group: str, prompt_len: int = 2, max_tokens: int = 100) -> Request:
    return Request(
        rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), group
    )


def _fair(
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    num_blocks: int = 256,
    threshold: int = 0,
    partial: int = 1,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_num_partial_prefills=partial,
        ),
        BlockManager(num_blocks, 4),
        max_model_len=1000,
        eos_token_ids=frozenset({EOS}),
        long_prefill_token_threshold=threshold,
    )


def test_fair_shares_are_max_min_fair() -> None:
    assert fair_shares({"a": 128}, 128) == {"a": 128}
    assert fair_shares({"a": 128, "b": 1}, 128) == {"a": 127, "b": 1}
    assert fair_shares({"a": 128, "b": 128}, 128) == {"a": 64, "b": 64}
    shares = fair_shares({"a": 100, "b": 3, "c": 100}, 10)
    assert shares["b"] == 3 and sorted([shares["a"], shares["c"]]) == [3, 4]
    assert sum(fair_shares({"a": 5, "b": 6, "c": 7}, 8).values()) == 8
    assert fair_shares({"a": 2, "b": 3}, 100) == {"a": 2, "b": 3}  # room for every demand


def test_fair_shares_break_ties_for_the_earlier_groups() -> None:
    # More single-request groups than slots: the first ones (the running ones, which the
    # scheduler lists first) keep their slots.
    demands = dict.fromkeys("abcdef", 1)
    assert fair_shares(demands, 3) == {"a": 1, "b": 1, "c": 1, "d": 0, "e": 0, "f": 0}
    assert fair_shares({"a": 2, "b": 1, "c": 1, "d": 1}, 3) == {"a": 1, "b": 1, "c": 1, "d": 0}


def test_more_single_requests_than_slots_wait_in_line_without_preemption() -> None:
    # Found by a helper: fair shares gave the running request's slot to a waiting one
    # every step, and with a small token budget nothing ever finished.
    scheduler = _fair(max_num_seqs=2)
    for i in range(5):
        scheduler.add(_grouped(f"r{i}", f"r{i}", max_tokens=3))
    finished: list[str] = []
    for _ in range(20):
        batch = scheduler.schedule()
        assert batch.num_preemptions == 0
        sampled = {
            r.request_id: 7 for r, n in batch.requests if r.num_computed_tokens + n == r.num_tokens
        }
        finished += [r.request_id for r in scheduler.update(batch, sampled)]
    assert finished == ["r0", "r1", "r2", "r3", "r4"]


def test_one_request_with_many_choices_cannot_keep_a_newcomer_out() -> None:
    scheduler = _fair(max_num_seqs=8)
    for i in range(8):
        scheduler.add(_grouped(f"big{i}", "big"))
    _step(scheduler)
    assert len(scheduler.running) == 8
    scheduler.add(_grouped("small", "small"))
    scheduled, _ = _step(scheduler)
    # The newest choice of the big request gave its slot back at once.
    assert ("small", 2) in scheduled
    assert "big7" not in [rid for rid, _ in scheduled]
    assert [r.request_id for r in scheduler.waiting] == ["big7"]
    # Balanced now: nothing more is preempted while both keep running.
    for _ in range(3):
        scheduled, _ = _step(scheduler)
        assert len(scheduled) == 8 and ("small", 1) in scheduled


def test_two_groups_with_many_choices_share_the_batch_evenly() -> None:
    scheduler = _fair(max_num_seqs=8)
    for i in range(8):
        scheduler.add(_grouped(f"a{i}", "a"))
    _step(scheduler)
    for i in range(8):
        scheduler.add(_grouped(f"b{i}", "b"))
    _step(scheduler)
    _step(scheduler)
    groups = [r.group for r in scheduler.running]
    assert groups.count("a") == 4 and groups.count("b") == 4


def test_without_groups_the_waiting_line_stays_first_come_first_served() -> None:
    scheduler = _fair(max_num_seqs=2)
    for name in "abcd":
        scheduler.add(_request(name, 2))
    _step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    scheduler.abort(["a"])
    _step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["b", "c"]


def test_a_long_prefill_takes_at_most_the_threshold_per_step() -> None:
    scheduler = _fair(budget=64, threshold=8)
    scheduler.add(_grouped("decode", "d", prompt_len=3))
    _step(scheduler)
    scheduler.add(_grouped("long", "l", prompt_len=40))
    scheduled, _ = _step(scheduler)
    assert scheduled == [("decode", 1), ("long", 8)]
    scheduler.add(_grouped("short", "s", prompt_len=5))
    scheduled, _ = _step(scheduler)
    # The newcomer's whole prompt goes in the same step as the next chunk.
    assert scheduled == [("decode", 1), ("long", 8), ("short", 5)]


def test_a_long_prefill_alone_takes_the_solo_chunk_until_another_request_comes() -> None:
    scheduler = _fair(budget=64, threshold=8)
    scheduler.solo_prefill_tokens = 20
    scheduler.add(_grouped("long", "l", prompt_len=50))
    assert _step(scheduler)[0] == [("long", 20)]  # alone: nothing to stall
    assert _step(scheduler)[0] == [("long", 20)]
    scheduler.add(_grouped("short", "s", prompt_len=3))
    assert _step(scheduler)[0] == [("long", 8), ("short", 3)]  # a stream runs beside it
    scheduler.abort(["short"])
    assert _step(scheduler)[0] == [("long", 2)]  # alone again: what is left, no more


def test_only_max_num_partial_prefills_long_prompts_prefill_per_step() -> None:
    scheduler = _fair(budget=64, threshold=8, partial=1)
    scheduler.add(_grouped("long1", "1", prompt_len=30))
    scheduler.add(_grouped("long2", "2", prompt_len=30))
    scheduler.add(_grouped("short", "3", prompt_len=4))
    scheduled, _ = _step(scheduler)
    # long2 waits for the long place; the short prompt goes ahead of it.
    assert scheduled == [("long1", 8), ("short", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["long2"]
    for _ in range(3):
        _step(scheduler)  # long1: 16, 24, 30 (done; the last chunk is short)
    scheduled, _ = _step(scheduler)
    assert ("long2", 8) in scheduled


def test_out_of_blocks_the_largest_group_gives_way_not_the_newcomer() -> None:
    # 10 blocks of 4 tokens; each request holds 1 block until its 5th token.
    scheduler = _fair(max_num_seqs=16, num_blocks=10)
    for i in range(8):
        scheduler.add(_grouped(f"big{i}", "big", prompt_len=3))
    _step(scheduler)
    scheduler.add(_grouped("small", "small", prompt_len=3))
    _step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 1
    _step(scheduler)  # every request now holds 4 tokens in 1 block... and grows to a 2nd
    running = {r.request_id for r in scheduler.running}
    assert "small" in running
    assert {r.request_id for r in scheduler.waiting} <= {f"big{i}" for i in range(8)}


def test_a_paused_request_is_not_scheduled_and_frees_its_blocks_until_resumed() -> None:
    scheduler = _fair()
    scheduler.add(_grouped("a", "a", prompt_len=5))
    scheduler.add(_grouped("b", "b", prompt_len=5))
    _step(scheduler)
    _step(scheduler)
    free = scheduler.block_manager.num_free_blocks
    assert [r.request_id for r in scheduler.pause(["b", "unknown"])] == ["b"]
    assert scheduler.block_manager.num_free_blocks == free + 2
    assert scheduler.pause(["b"]) == []  # already paused
    for _ in range(3):
        scheduled, _ = _step(scheduler)
        assert scheduled == [("a", 1)]
    paused = scheduler.paused["b"]
    assert paused.status is RequestStatus.PAUSED and paused.num_output_tokens == 2
    assert scheduler.num_unfinished == 2 and scheduler.has_work
    scheduler.resume(["b"])
    scheduled, _ = _step(scheduler)
    assert scheduled == [("a", 1), ("b", 7)]  # prompt + its 2 outputs recomputed
    scheduler.pause(["b"])
    assert [r.request_id for r in scheduler.abort(["b"])] == ["b"]
    assert not scheduler.paused and scheduler.num_unfinished == 1


def test_only_paused_requests_left_means_no_work() -> None:
    scheduler = _fair()
    scheduler.add(_grouped("a", "a"))
    scheduler.pause(["a"])
    assert not scheduler.has_work and scheduler.num_unfinished == 1
    assert scheduler.schedule().is_empty()


def test_a_request_waiting_for_its_grammar_is_skipped_without_claiming_a_slot() -> None:
    scheduler = _fair(max_num_seqs=2)
    scheduler.add(_grouped("a", "a"))
    compiling = _grouped("c", "c")
    compiling.grammar = object()  # what the engine core sets while the grammar compiles
    scheduler.add(compiling)
    scheduler.add(_grouped("b", "b"))
    # Neither admitted nor given blocks; the request behind it goes ahead.
    assert _step(scheduler)[0] == [("a", 2), ("b", 2)]
    assert compiling.block_table == [] and list(scheduler.waiting) == [compiling]
    # The batch is full, but a request waiting for its grammar preempts no one.
    for _ in range(3):
        scheduled, _ = _step(scheduler)
        assert scheduled == [("a", 1), ("b", 1)]
    scheduler.abort(["a", "b"])
    assert not scheduler.has_work and scheduler.num_unfinished == 1
    assert scheduler.schedule().is_empty()
    compiling.grammar = None  # compiled: the engine core gave it its matcher
    assert scheduler.has_work and _step(scheduler)[0] == [("c", 2)]
