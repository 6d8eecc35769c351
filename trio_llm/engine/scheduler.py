"""Continuous batching: which requests run in the next step, and how many tokens each.

The policy follows vLLM V1's scheduler. There is no separate prefill or decode phase: each
request simply has some tokens whose keys/values are not yet in the KV cache
(``num_uncomputed_tokens``: the whole prompt at first, then one sampled token per step),
and each step hands out a token budget (``max_num_batched_tokens``):

1. Running requests first, oldest first. Each gets ``min(uncomputed, budget left)`` tokens,
   so a long prompt is prefilled in chunks across steps. When the KV cache has no room,
   the newest running request is preempted (blocks freed, progress reset; it is
   recomputed from its prompt plus its outputs when rescheduled) until the request fits,
   or until the request being scheduled is itself the newest.
2. Then, if nothing was preempted this step, waiting requests join in arrival order while
   the batch has fewer than ``max_num_seqs`` requests, budget remains and blocks are free.
   With prefix caching, a joining request first takes the cached blocks of its longest
   cached prefix and only computes the rest (`BlockManager.lookup`).

After the model ran, `Scheduler.update` records the sampled tokens and finishes requests
(EOS / stop token -> "stop", ``max_tokens`` or a full context -> "length").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from trio_llm.config import SchedulerConfig
from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The work of one step.

    Attributes:
        requests: the scheduled requests with the number of new tokens each computes, in
            the order their tokens are packed into the model input.
        num_preemptions: requests preempted while building this batch.
    """

    requests: list[tuple[Request, int]] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(n for _, n in self.requests)

    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.requests


class Scheduler:
    """Owns the waiting queue and the running batch of an engine core.

    Args:
        config: ``max_num_seqs`` and ``max_num_batched_tokens``.
        block_manager: the KV block allocator shared with the model runner.
        max_model_len: context length; a request whose sequence reaches it finishes.
        eos_token_ids: ids that finish a request unless ``ignore_eos``.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}

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
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.block_manager.free(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
            aborted.append(request)
        return aborted

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    # ------------------------------------------------------------ one step

    def schedule(self) -> ScheduledBatch:
        """Choose the requests and token counts of the next step (see the module docstring)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self._make_room(request, request.num_computed_tokens + num_new, batch):
                break  # the request itself was preempted; everything after it is gone too
            self.block_manager.allocate(request, request.num_computed_tokens + num_new)
            batch.requests.append((request, num_new))
            budget -= num_new
            index += 1

        if batch.num_preemptions:
            return batch
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = manager.lookup(request)
            num_cached = len(hits) * manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not manager.can_take(request, hits, num_cached + num_new):
                break
            self.waiting.popleft()
            if request.queue_seconds is None:
                request.queue_seconds = time.monotonic() - request.arrival_time
            manager.take(request, hits)
            manager.allocate(request, num_cached + num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append((request, num_new))
            budget -= num_new
        return batch

    def _make_room(self, request: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running requests until ``request`` fits; False if it was one."""
        while not self.block_manager.can_allocate(request, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            batch.num_preemptions += 1
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
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
                self.block_manager.free(request)
                del self._requests[request.request_id]
                finished.append(request)
        return finished

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
