"""The engine's view of one request: its tokens, progress and KV blocks."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

import torch

from trio_llm.messages import SamplingParams

#: A block-table entry where a sliding-window KV cache group holds no block.
NO_BLOCK = -1

#: Numbers the requests of this process in arrival order (`Request.arrival_index`).
_arrivals = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # its consumer stopped reading: not scheduled until resumed
    FINISHED = "finished"


class Request:
    """A request inside the engine core.

    Attributes:
        group: the requests of one API request (its ``n`` choices, its batch of prompts)
            share a group; the scheduler shares batch slots fairly between groups.
        priority: lower is handled earlier, under the ``priority`` scheduling policy
            (`trio_llm.engine.request_queue`; `Scheduling.priority`).
        batch: in the batch lane (`Scheduling.batch`): ranks after every interactive
            request.
        arrival_index: the order of arrival among this process's requests (ties of
            ``arrival_time`` broken).
        token_ids: prompt followed by every sampled token (the sequence the model sees).
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        num_computed_tokens: how many leading tokens have their keys/values in the KV cache.
            Reset to 0 on preemption (the request is recomputed later).
        block_tables: one table per KV cache group (`BlockManager`): entry ``i`` is the
            block holding tokens ``[i * block_size, (i + 1) * block_size)`` for the layers
            of that group, or ``NO_BLOCK`` where a sliding-window group holds none (behind
            its window). ``block_table`` is group 0's.
        block_keys: prefix-cache keys of the leading full blocks of ``token_ids``, filled
            in lazily by the `BlockManager` (32 bytes each; they depend on tokens only).
        num_registered: per group, leading blocks already offered to the prefix cache.
        generator: per-request RNG when ``params.seed`` is set (CPU), else None.
        arrival_time: ``time.monotonic()`` when the engine received the request (seconds).
        queue_seconds: seconds from arrival to the first scheduling; None until then.
        queue_time_reported: whether an output already carried ``queue_seconds``.
        num_cached_tokens: prompt tokens found in the prefix cache at the first
            scheduling (None until then; not changed by later ones, as in vLLM).
        next_prompt_logprob: the next prompt position whose logprob is to be reported
            (positions ``1 .. num_prompt_tokens - 1``; kept across preemptions so no
            position is reported twice).
    """

    __slots__ = (
        "adapter",
        "arrival_index",
        "arrival_time",
        "batch",
        "block_keys",
        "block_tables",
        "error",
        "finish_reason",
        "generator",
        "grammar",
        "grammar_done",
        "group",
        "matcher",
        "next_prompt_logprob",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_registered",
        "params",
        "priority",
        "queue_seconds",
        "queue_time_reported",
        "request_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        group: str | None = None,
        *,
        priority: int = 0,
        batch: bool = False,
    ) -> None:
        self.request_id = request_id
        self.group = group if group is not None else request_id
        self.priority = priority
        self.batch = batch
        self.arrival_index = next(_arrivals)
        self.params = params
        #: The loaded LoRA adapter of ``params.lora`` (`trio_llm.engine.lora`), or None.
        self.adapter: object | None = None
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_tables: list[list[int]] = [[]]
        self.block_keys: list[bytes] = []
        self.num_registered: list[int] = [0]
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        self.arrival_time = time.monotonic()
        self.queue_seconds: float | None = None
        self.queue_time_reported = False
        self.num_cached_tokens: int | None = None
        self.next_prompt_logprob = 1
        #: The llguidance matcher of a constrained output (`trio_llm.engine.grammar_compiler`).
        self.matcher: Any = None
        #: The compile of its grammar while it runs (a ``concurrent.futures.Future``): the
        #: scheduler leaves the request waiting, unscheduled, until the engine core sets
        #: `matcher` from it and this back to None.
        self.grammar: Any = None
        #: Its matcher's grammar is complete (EOS, or nothing can follow): it stops.
        self.grammar_done = False
        #: Why the engine ended the request (finish_reason "abort"), e.g. a token the
        #: matcher rejected.
        self.error: str | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def block_table(self) -> list[int]:
        """The block table of KV cache group 0 (the only group of a model without
        sliding windows; with them, possibly a window group with ``NO_BLOCK`` entries)."""
        return self.block_tables[0]

    @property
    def waits_for_grammar(self) -> bool:
        """True while its grammar is compiling (it must not be scheduled yet)."""
        return self.grammar is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt position's logprob is still to be reported."""
        return (
            self.params.prompt_logprobs is not None
            and self.next_prompt_logprob < self.num_prompt_tokens
        )

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose keys/values are not yet in the KV cache."""
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
