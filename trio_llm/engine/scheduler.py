"""Continuous batching: which requests run in the next step, and how many tokens each.

The policy follows vLLM V1's scheduler. There is no separate prefill or decode phase: each
request simply has some tokens whose keys/values are not yet in the KV cache
(``num_uncomputed_tokens``: the whole prompt at first, then one sampled token per step),
and each step hands out a token budget (``max_num_batched_tokens``). Requests *rank*
(`trio_llm.engine.request_queue`): interactive ones before the batch lane, then by
priority under ``--scheduling-policy priority``; with one rank for all (the default) ranks
change nothing below.

1. Batch slots first. When requests wait for a batch slot (``max_num_seqs``) and the
   batch is full, running requests give theirs back (preempted;
   `trio_llm.engine.slot_shares`): worse-ranked ones to better-ranked ones (the batch
   lane only down to its share, ``--max-batch-share``, while interactive requests wait),
   and within a rank by max-min fair shares between *groups* (the requests of one API
   request: its ``n`` choices, its prompts), so a short request arriving behind one
   ``n=128`` request joins at the next step.
2. Running requests, in rank order, oldest first. Each gets ``min(uncomputed, budget
   left)`` tokens, so a long prompt is prefilled in chunks across steps. A request with
   more than ``long_prefill_token_threshold`` tokens left is *long*: it takes at most that
   many per step, and at most ``max_num_partial_prefills`` long requests prefill in one
   step, so one long prompt cannot stall every running stream (vLLM's names); alone (no
   other request running or waiting) it takes up to ``solo_prefill_tokens`` (0: the
   threshold; the engine sets it on the CPU). When the KV cache has no room, a request
   is preempted (blocks freed, progress reset; it is recomputed from its prompt plus its
   outputs when rescheduled): of those not yet scheduled in this step, the newest of the
   worst rank's group holding the most slots.
3. Then, if nothing was preempted for room this step, waiting requests join while the
   batch has fewer than ``max_num_seqs`` requests, budget remains and blocks are free:
   the best rank first, then those whose group holds the fewest slots, in line order
   (`RequestQueue.next_ready`). A long one waits while the long prefill places are taken,
   and a short one may go ahead of it. One that finds no KV blocks takes those of
   worse-ranked running requests (preempted, the worst first), or waits. With prefix
   caching, a joining request first takes the cached blocks of its longest cached prefix
   and only computes the rest (`BlockManager.lookup`). One of a LoRA adapter the running
   batch has no place for (``max_loras``: `trio_llm.engine.lora.lora_fits`) waits.

Steps 2 and 3 run for the interactive requests, then for the batch lane: interactive
requests come first in the token budget, and the batch lane joins only while no
interactive request waits. Paused requests (`pause`: their consumer stopped reading) sit
outside both queues, with no KV blocks, until `resume`. A request waiting for its grammar
(`Request.waits_for_grammar`) stays in the waiting queue, skipped, holding nothing.

After the model ran, `Scheduler.update` records the sampled tokens and finishes requests
(EOS / stop token -> "stop", ``max_tokens`` or a full context -> "length").
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from trio_llm.config import SchedulerConfig
from trio_llm.engine.batch_lane import BatchLaneThrottle
from trio_llm.engine.block_manager import BlockManager, PrefixHit
from trio_llm.engine.lora import lora_fits
from trio_llm.engine.request import Request, RequestStatus
from trio_llm.engine.request_queue import Rank, RequestQueue
from trio_llm.engine.scheduled_batch import ScheduledBatch
from trio_llm.engine.slot_shares import fair_shares, slot_victims

__all__ = ["ScheduledBatch", "Scheduler", "fair_shares"]


@dataclass
class _Step:
    """What is left of a step being scheduled: its token budget, the long prefills it
    holds, and whether waiting requests may still join (not after a preemption for room or
    for blocks, nor behind a waiting request that could not join)."""

    budget: int
    num_long: int = 0
    admitting: bool = True
    #: Tokens the batch lane may still compute in this step (`BatchLaneThrottle`).
    batch_budget: int | None = None

    def cap(self, request: Request, num_new: int) -> int:
        """``num_new`` within what the batch lane may still take (for its requests)."""
        if request.batch and self.batch_budget is not None:
            return min(num_new, self.batch_budget)
        return num_new

    def take(self, request: Request, num_new: int, long: bool) -> None:
        """Count ``num_new`` scheduled tokens of ``request`` against the budgets."""
        self.budget -= num_new
        self.num_long += long
        if request.batch and self.batch_budget is not None:
            self.batch_budget -= num_new


class Scheduler:
    """Owns the waiting queue, the running batch and the paused requests of an engine core.

    Args:
        config: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_num_partial_prefills``,
            the scheduling policy and the batch lane's share.
        block_manager: the KV block allocator shared with the model runner.
        max_model_len: context length; a request whose sequence reaches it finishes.
        eos_token_ids: ids that finish a request unless ``ignore_eos``.
        long_prefill_token_threshold: tokens (0: off); see the module docstring. The
            engine resolves `SchedulerConfig.long_prefill_token_threshold` for its device.
        clock: monotonic seconds, for the batch lane's throttle (`BatchLaneThrottle`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        long_prefill_token_threshold: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        #: The batch lane's share of each step while interactive requests are served.
        self.throttle = BatchLaneThrottle(config.batch_lane_slots, clock)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.solo_prefill_tokens = 0
        self.max_loras = 1  # LoRA adapters the running batch holds at most
        #: Waiting requests, best rank first (`RequestQueue`).
        self.waiting = RequestQueue(config.scheduling_policy)
        #: A request's rank (`RequestQueue.rank`): lane, then priority; lower is better.
        self.rank = self.waiting.rank
        #: Running requests in rank order, then in the order they started running.
        self.running: list[Request] = []
        self.paused: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        self._num_running: Counter[str] = Counter()  # group -> its running requests

    # ------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        """Queue a request behind the waiting requests of its rank.

        Raises:
            ValueError: the id is already in use.
        """
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Remove requests wherever they are and free their blocks; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            self._leave_queues(request)
            self.block_manager.free(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
            aborted.append(request)
        return aborted

    def pause(self, request_ids: list[str]) -> list[Request]:
        """Take requests out of scheduling until `resume`, freeing their KV blocks.

        A running request is preempted (recomputed on resume; with prefix caching its full
        blocks usually still are in the cache then). Unknown, finished or already paused
        ids are ignored. Returns the requests paused now.
        """
        paused = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None or request.status is RequestStatus.PAUSED:
                continue
            self._leave_queues(request)
            self.block_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PAUSED
            self.paused[request_id] = request
            paused.append(request)
        return paused

    def resume(self, request_ids: list[str]) -> None:
        """Put paused requests back in line (`RequestQueue.prepend`: under ``fcfs`` at the
        front of their lane); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.WAITING
                self.waiting.prepend(request)

    def _leave_queues(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._drop_running_count(request.group)
        elif request.status is RequestStatus.PAUSED:
            del self.paused[request.request_id]
        else:
            self.waiting.remove(request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, running or paused."""
        return len(self._requests)

    @property
    def has_work(self) -> bool:
        """True when a step could schedule something (a request is running, or waiting and
        not for its grammar)."""
        return bool(self.running) or any(not r.waits_for_grammar for r in self.waiting)

    # ------------------------------------------------------------ one step

    def schedule(self) -> ScheduledBatch:
        """Choose the requests and token counts of the next step (see the module docstring)."""
        batch = ScheduledBatch()
        self._share_slots(batch)
        step = _Step(self.config.max_num_batched_tokens)
        step.batch_budget = self.throttle.budget(
            interactive_waiting=any(not r.batch and not r.waits_for_grammar for r in self.waiting),
            interactive_running=any(not r.batch for r in self.running),
        )
        index = 0  # running[:index] had their turn
        while True:
            running = self.rank(self.running[index]) if index < len(self.running) else None
            waiting = self._first_ready_rank() if step.admitting else None
            if waiting is not None and (running is None or waiting < running):
                index += self._admit_waiting(batch, step, waiting)
            elif running is not None and step.budget > 0:
                index = self._schedule_running(batch, step, index)
            else:
                return batch

    def _first_ready_rank(self) -> Rank | None:
        """The rank of the first waiting request not waiting for its grammar."""
        ready = next((r for r in self.waiting if not r.waits_for_grammar), None)
        return self.rank(ready) if ready is not None else None

    def _schedule_running(self, batch: ScheduledBatch, step: _Step, index: int) -> int:
        """Schedule the running requests of the rank of ``running[index]`` (step 2 of the
        module docstring); returns the index after the last one that had its turn."""
        level = self.rank(self.running[index])
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            if self.rank(request) != level:
                break
            num_uncomputed = request.num_uncomputed_tokens
            num_new, long = self._num_new_tokens(num_uncomputed, step.budget, step.num_long)
            num_new = step.cap(request, num_new)
            if num_new == 0:
                index += 1  # a long prefill waiting for its turn, or the batch lane's
                continue
            preempted_before = batch.num_preemptions
            fits = self._make_room(index, request.num_computed_tokens + num_new, batch)
            if batch.num_preemptions > preempted_before:
                step.admitting = False  # preempted for room: no request joins this step
            if not fits:
                continue  # the request itself was preempted; running[index] is the next one
            self.block_manager.allocate(request, request.num_computed_tokens + num_new)
            batch.add(request, num_new)
            step.take(request, num_new, long)
            index += 1
        return index

    def _admit_waiting(self, batch: ScheduledBatch, step: _Step, level: Rank) -> int:
        """Let the waiting requests of rank ``level`` join (step 3 of the module
        docstring); returns how many joined. If one of that rank is left waiting, or
        worse-ranked requests were preempted for blocks, no other request joins in this
        step (the preempted ones are not taken back at once)."""
        manager = self.block_manager
        admitted = 0
        preempted_before = batch.num_preemptions
        while step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            long_taken = step.num_long >= self.config.max_num_partial_prefills
            request = self.waiting.next_ready(level, self._num_running, self._is_long, long_taken)
            if request is None or not lora_fits(self.running, request.params.lora, self.max_loras):
                break
            hit = manager.lookup(request)
            num_cached = hit.num_blocks * manager.block_size
            num_uncomputed = request.num_tokens - num_cached
            num_new, long = self._num_new_tokens(num_uncomputed, step.budget, step.num_long)
            num_new = step.cap(request, num_new)
            if num_new == 0:
                break
            if not manager.can_take(request, hit, num_cached + num_new):
                if self._preempt_worse_ranked(level, batch):
                    continue  # look again with the blocks it freed
                break
            self._start(request, hit, num_cached, num_new)
            batch.add(request, num_new)
            step.take(request, num_new, long)
            admitted += 1
        if self._first_ready_rank() == level or batch.num_preemptions > preempted_before:
            step.admitting = False  # worse-ranked requests do not go ahead of it
        return admitted

    def _start(self, request: Request, hit: PrefixHit, num_cached: int, num_new: int) -> None:
        """Move a waiting request into the running batch with its cached prefix ``hit``
        and blocks for ``num_new`` more tokens."""
        self.waiting.remove(request)
        if request.queue_seconds is None:
            request.queue_seconds = time.monotonic() - request.arrival_time
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
        self.block_manager.take(request, hit)
        self.block_manager.allocate(request, num_cached + num_new)
        self._start_running(request)

    def _preempt_worse_ranked(self, level: Rank, batch: ScheduledBatch) -> bool:
        """Free KV blocks for a waiting request of rank ``level``: preempt the worst-ranked
        running request ranked below it (of that rank, the newest of the group holding the
        most slots); False if there is none. (Those ranked below it have not had their
        turn in this step: `schedule` goes rank by rank.)"""
        worse = [i for i, other in enumerate(self.running) if self.rank(other) > level]
        if not worse:
            return False
        self._preempt(self.running[max(worse, key=self._victim_order)])
        batch.num_preemptions += 1
        return True

    def _victim_order(self, index: int) -> tuple[tuple[int, int], int, int]:
        """How much ``running[index]`` is a victim for room: worst rank, then the group
        holding the most slots, then the newest (the largest is preempted first)."""
        request = self.running[index]
        return (self.rank(request), self._num_running[request.group], index)

    def _is_long(self, num_uncomputed: int) -> bool:
        return 0 < self.long_prefill_token_threshold < num_uncomputed

    def _num_new_tokens(self, num_uncomputed: int, budget: int, num_long: int) -> tuple[int, bool]:
        """Tokens to compute for a request with ``num_uncomputed`` left, and whether it is
        long; 0 when it is long and the long places of this step are taken."""
        if self._is_long(num_uncomputed):
            if num_long >= self.config.max_num_partial_prefills:
                return 0, True
            limit = self.long_prefill_token_threshold
            if len(self.running) + len(self.waiting) <= 1:  # alone: no stream to stall
                limit = min(max(limit, self.solo_prefill_tokens), num_uncomputed)
            return min(limit, budget), True
        return min(num_uncomputed, budget), False

    def _share_slots(self, batch: ScheduledBatch) -> None:
        """Preempt running requests for waiting ones that find no free batch slot
        (`trio_llm.engine.slot_shares.slot_victims`)."""
        free = self.config.max_num_seqs - len(self.running)
        if not self.waiting or free >= len(self.waiting):
            return
        victims = slot_victims(
            self.running,
            [request for request in self.waiting if not request.waits_for_grammar],
            self._num_running,
            max_num_seqs=self.config.max_num_seqs,
            rank=self.rank,
            batch_lane_slots=self.config.batch_lane_slots,
        )
        for victim in victims:
            self._preempt(victim)
            batch.num_preemptions += 1

    def _make_room(self, index: int, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt requests not yet scheduled this step until ``running[index]`` fits
        ``num_tokens``; False if it was preempted itself.

        The victim is the newest request of the worst rank's group holding the most
        running requests (with every request its own group and of one rank: the newest
        request).
        """
        request = self.running[index]
        while not self.block_manager.can_allocate(request, num_tokens):
            victim = max(range(index, len(self.running)), key=self._victim_order)
            victim_request = self.running[victim]
            self._preempt(victim_request)
            batch.num_preemptions += 1
            if victim_request is request:
                return False
        return True

    def _start_running(self, request: Request) -> None:
        """Add ``request`` to the running batch, behind the running requests of its rank."""
        request.status = RequestStatus.RUNNING
        level = self.rank(request)
        index = len(self.running)
        while index and self.rank(self.running[index - 1]) > level:
            index -= 1
        self.running.insert(index, request)
        self._num_running[request.group] += 1

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._drop_running_count(request.group)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.prepend(request)

    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """Advance progress after the model ran; returns the requests that finished.

        Args:
            batch: what `schedule` returned for this step.
            sampled: the new token of every request whose whole sequence is now computed,
                by request id. Requests in the middle of a chunked prefill have none. A
                request with ``max_tokens=0`` finishes ("length") without its token.
        """
        finished = []
        for request, num_new in batch.requests:
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request)
            self.block_manager.release_behind_window(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.params.max_tokens == 0:
                reason = "length"  # only the prompt was wanted (its logprobs)
            else:
                request.token_ids.append(token)
                reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_reason = reason
                request.status = RequestStatus.FINISHED
                self.running.remove(request)
                self._drop_running_count(request.group)
                self.block_manager.free(request)
                del self._requests[request.request_id]
                finished.append(request)
        return finished

    def _drop_running_count(self, group: str) -> None:
        self._num_running[group] -= 1
        if not self._num_running[group]:
            del self._num_running[group]

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if request.error is not None:
            return "abort"
        if request.grammar_done:
            return "stop"  # the grammar is complete (EOS, or nothing can follow)
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
