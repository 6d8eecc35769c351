"""Continuous batching: which requests run in the next step, and how many tokens each.

The policy follows vLLM V1's scheduler. There is no separate prefill or decode phase: each
request simply has some tokens whose keys/values are not yet in the KV cache
(``num_uncomputed_tokens``: the whole prompt at first, then one sampled token per step),
and each step hands out a token budget (``max_num_batched_tokens``):

1. Fair shares first. The requests of one API request (its ``n`` choices, its batch of
   prompts) form a *group*. When requests wait for a batch slot (``max_num_seqs``) and
   the batch is full, slots are shared max-min fairly between groups (`fair_shares`): a
   group holding more than its share gives back its newest requests (preempted), so a
   short request arriving behind one ``n=128`` request joins at the next step.
2. Running requests, oldest first. Each gets ``min(uncomputed, budget left)`` tokens, so
   a long prompt is prefilled in chunks across steps. A request with more than
   ``long_prefill_token_threshold`` tokens left is *long*: it takes at most that many
   per step, and at most ``max_num_partial_prefills`` long requests prefill in one step,
   so one long prompt cannot stall every running stream (vLLM's names). When the KV
   cache has no room, a request is preempted (blocks freed, progress reset; it is
   recomputed from its prompt plus its outputs when rescheduled): the newest request of
   the group holding the most slots, among those not yet scheduled in this step.
3. Then, if nothing was preempted for room this step, waiting requests join while the
   batch has fewer than ``max_num_seqs`` requests, budget remains and blocks are free:
   first those whose group holds the fewest slots, in arrival order within that (plain
   arrival order when every request is its own group). A long one waits while the long
   prefill places are taken, and a short one may go ahead of it. With prefix caching,
   a joining request first takes the cached blocks of its longest cached prefix and only
   computes the rest (`BlockManager.lookup`).

Paused requests (`pause`: their consumer stopped reading) sit outside both queues, with
no KV blocks, until `resume` puts them back in line. A request waiting for its grammar
(`Request.waits_for_grammar`: a structured output compiling in a worker thread) stays in
the waiting queue, skipped: it is not admitted, holds no KV blocks and claims no batch
slot in the fair shares until the engine core gives it its matcher.

After the model ran, `Scheduler.update` records the sampled tokens and finishes requests
(EOS / stop token -> "stop", ``max_tokens`` or a full context -> "length").
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from trio_llm.config import SchedulerConfig
from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The work of one step.

    Attributes:
        requests: the scheduled requests with the number of new tokens each computes:
            running requests in the running queue's order, then the requests admitted
            this step in admission order. (The model runner packs single-token requests
            first, then the longer chunks, each part in this order.)
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


class Scheduler:
    """Owns the waiting queue, the running batch and the paused requests of an engine core.

    Args:
        config: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_num_partial_prefills``.
        block_manager: the KV block allocator shared with the model runner.
        max_model_len: context length; a request whose sequence reaches it finishes.
        eos_token_ids: ids that finish a request unless ``ignore_eos``.
        long_prefill_token_threshold: tokens (0: off); see the module docstring. The
            engine resolves `SchedulerConfig.long_prefill_token_threshold` for its device.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        self._num_running: Counter[str] = Counter()  # group -> its running requests

    # ------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        """Queue a request at the back of the waiting queue.

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
        """Put paused requests back at the front of the waiting queue (unknown ids: ignored)."""
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)

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
        budget = self.config.max_num_batched_tokens
        num_long = 0
        out_of_room = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new, long = self._num_new_tokens(request.num_uncomputed_tokens, budget, num_long)
            if num_new == 0:
                index += 1  # a long prefill waiting for its turn
                continue
            preempted_before = batch.num_preemptions
            fits = self._make_room(index, request.num_computed_tokens + num_new, batch)
            out_of_room |= batch.num_preemptions > preempted_before
            if not fits:
                continue  # the request itself was preempted; running[index] is the next one
            self.block_manager.allocate(request, request.num_computed_tokens + num_new)
            self._add(batch, request, num_new)
            budget -= num_new
            num_long += long
            index += 1

        if out_of_room:
            return batch
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting(skip_long=num_long >= self._max_long)
            if request is None:
                break
            hit = manager.lookup(request)
            num_cached = hit.num_blocks * manager.block_size
            num_new, long = self._num_new_tokens(request.num_tokens - num_cached, budget, num_long)
            if num_new == 0 or not manager.can_take(request, hit, num_cached + num_new):
                break
            self.waiting.remove(request)
            if request.queue_seconds is None:
                request.queue_seconds = time.monotonic() - request.arrival_time
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            manager.take(request, hit)
            manager.allocate(request, num_cached + num_new)
            self._start_running(request)
            self._add(batch, request, num_new)
            budget -= num_new
            num_long += long
        return batch

    @staticmethod
    def _add(batch: ScheduledBatch, request: Request, num_new: int) -> None:
        """Append ``request`` computing ``num_new`` tokens (before they are computed)."""
        batch.requests.append((request, num_new))
        position = request.num_computed_tokens
        is_decode = (
            num_new == 1
            and position == request.num_tokens - 1
            and position >= request.num_prompt_tokens
        )
        if not is_decode:
            batch.num_prefill_tokens += num_new

    @property
    def _max_long(self) -> int:
        return self.config.max_num_partial_prefills

    def _is_long(self, num_uncomputed: int) -> bool:
        threshold = self.long_prefill_token_threshold
        return 0 < threshold < num_uncomputed

    def _num_new_tokens(self, num_uncomputed: int, budget: int, num_long: int) -> tuple[int, bool]:
        """Tokens to compute for a request with ``num_uncomputed`` left, and whether it is
        long; 0 when it is long and the long places of this step are taken."""
        if self._is_long(num_uncomputed):
            if num_long >= self._max_long:
                return 0, True
            return min(self.long_prefill_token_threshold, budget), True
        return min(num_uncomputed, budget), False

    def _next_waiting(self, *, skip_long: bool) -> Request | None:
        """The waiting request to admit next: of the group with the fewest running
        requests, the first in the queue (long ones skipped when ``skip_long``, and those
        waiting for their grammar always)."""
        best: Request | None = None
        best_count = 0
        for request in self.waiting:
            if request.waits_for_grammar or (skip_long and self._is_long(request.num_tokens)):
                continue
            count = self._num_running[request.group]
            if best is None or count < best_count:
                best, best_count = request, count
                if count == 0:
                    break
        return best

    def _share_slots(self, batch: ScheduledBatch) -> None:
        """Preempt requests of groups above their fair share while others wait for a slot."""
        free = self.config.max_num_seqs - len(self.running)
        if not self.waiting or free >= len(self.waiting):
            return
        ready = [request for request in self.waiting if not request.waits_for_grammar]
        if free >= len(ready):
            return
        num_waiting: Counter[str] = Counter(request.group for request in ready)
        demands = {
            group: self._num_running[group] + num_waiting[group]
            for group in (*self._num_running, *num_waiting)
            if self._num_running[group] + num_waiting[group] > 0
        }
        shares = fair_shares(demands, self.config.max_num_seqs)
        wanted = sum(
            min(count, max(0, shares[group] - self._num_running[group]))
            for group, count in num_waiting.items()
        )
        excess = {
            group: count - shares[group]
            for group, count in self._num_running.items()
            if count > shares.get(group, 0)
        }
        for _ in range(wanted - free):
            if not excess:
                break
            group = max(excess, key=excess.__getitem__)
            victim = next(r for r in reversed(self.running) if r.group == group)
            self._preempt(victim)
            batch.num_preemptions += 1
            excess[group] -= 1
            if not excess[group]:
                del excess[group]

    def _make_room(self, index: int, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt requests not yet scheduled this step until ``running[index]`` fits
        ``num_tokens``; False if it was preempted itself.

        The victim is the newest request of the group holding the most running requests
        (with every request its own group: the newest request).
        """
        request = self.running[index]
        while not self.block_manager.can_allocate(request, num_tokens):
            victim = max(
                range(index, len(self.running)),
                key=lambda i: (self._num_running[self.running[i].group], i),
            )
            victim_request = self.running[victim]
            self._preempt(victim_request)
            batch.num_preemptions += 1
            if victim_request is request:
                return False
        return True

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._num_running[request.group] += 1

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._drop_running_count(request.group)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

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
        if request.matcher is not None and request.matcher.is_stopped():
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
