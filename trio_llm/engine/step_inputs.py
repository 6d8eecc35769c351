"""The packed input of one step: token ids, positions, cache slots and attention metadata.

All scheduled tokens of all requests are packed into one sequence (batch size 1):
single-token requests (decode) first, then prefill chunks. The requests are read once, in
Python, into one int64 staging buffer (token ids, each request's first position and
token count, the sampled rows, the padded block tables), copied to the model's device in
one transfer (from pinned memory, without waiting, on a GPU: `StepStager`); positions
and cache slots are then derived there with tensor operations (`StepBuilder`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trio_llm.engine.attention_metadata import PagedAttentionMetadata, PrefillBatch, PrefillSpan
from trio_llm.engine.block_manager import cdiv
from trio_llm.engine.kv_cache import KVCache, context_slots
from trio_llm.engine.request import Request
from trio_llm.engine.scheduled_batch import ScheduledBatch


@dataclass
class StepInputs:
    """The packed input of one step, on the model's device (built by `StepBuilder`).

    Attributes:
        input_ids: int64 ``[T]`` token ids, packed (decodes first, then prefill chunks).
        positions: int64 ``[T]`` the position of each packed token in its request.
        attention: where the step's keys and values go and which ones each token
            attends to: the slots, the decodes' padded block tables and context
            lengths, one `PrefillSpan` per chunk and, when the runner attends the
            chunks in one call, their `PrefillBatch`.
        sample_rows: int64 ``[S]`` packed rows whose logits are sampled.
        sample_requests: the ``S`` requests that sample a token this step.
        prompt_rows: ``(request, first_target, row, count)`` for prompt logprobs.
        scheduled: ``(request, new tokens)`` in packed order (rows of a request follow
            each other).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: PagedAttentionMetadata
    sample_rows: torch.Tensor
    sample_requests: list[Request]
    prompt_rows: list[tuple[Request, int, int, int]]
    scheduled: list[tuple[Request, int]]


@dataclass
class _HostInputs:
    """What a step reads from its requests in Python, in packed order (decodes first).

    Attributes:
        scheduled: ``(request, new tokens)`` per request.
        num_decode: the first ``num_decode`` requests have one new token.
        ids: the packed token ids.
        starts: each request's first new position (its computed tokens).
        counts: each request's new tokens.
        sample_rows: packed rows of the requests that sample (their last token).
        sample_requests: those requests.
        prompt_rows: ``(request, first_target, row, count)`` for prompt logprobs.
    """

    scheduled: list[tuple[Request, int]]
    num_decode: int
    ids: list[int]
    starts: list[int]
    counts: list[int]
    sample_rows: list[int]
    sample_requests: list[Request]
    prompt_rows: list[tuple[Request, int, int, int]]

    @property
    def ends(self) -> list[int]:
        """Each request's context length after this step."""
        return [s + n for s, n in zip(self.starts, self.counts, strict=True)]


def _prompt_row(request: Request, start: int, n: int, row: int) -> tuple[int, int, int] | None:
    """``(first_target, row, count)`` of the prompt positions whose logprobs ``request``
    computes this step (its ``n`` new tokens from position ``start``, the first at packed
    ``row``), or None. Position p's hidden state predicts token p + 1."""
    first = max(start + 1, request.next_prompt_logprob)
    last = min(start + n + 1, request.num_prompt_tokens)
    if n == 1 and request.next_prompt_logprob == start + 1:
        return start + 1, row, 1
    if n > 1 and first < last:
        return first, row + first - 1 - start, last - first
    return None


def _read_requests(batch: ScheduledBatch) -> _HostInputs:
    """The batch's requests in packed order, read into Python lists."""
    decodes = [(request, 1) for request, n in batch.requests if n == 1]
    chunks = [(request, n) for request, n in batch.requests if n > 1]
    host = _HostInputs(decodes + chunks, len(decodes), [], [], [], [], [], [])
    for request, n in host.scheduled:
        start = request.num_computed_tokens
        end = start + n
        if request.wants_prompt_logprobs:
            prompt = _prompt_row(request, start, n, len(host.ids))
            if prompt is not None:
                host.prompt_rows.append((request, *prompt))
        host.ids.extend(request.token_ids[start:end])
        host.starts.append(start)
        host.counts.append(n)
        if end == request.num_tokens:
            host.sample_rows.append(len(host.ids) - 1)
            host.sample_requests.append(request)
    return host


def _block_tables(scheduled: list[tuple[Request, int]], num_groups: int, columns: int) -> list[int]:
    """Every group's block table of every request, each padded with 0 to ``columns``."""
    tables: list[int] = []
    for group in range(num_groups):
        for request, _ in scheduled:
            table = request.block_tables[group][:columns]
            tables.extend(table)
            tables.extend([0] * (columns - len(table)))
    return tables


class StepStager:
    """Moves a step's int64 values to the model's device: on a GPU through a reused pinned
    buffer and one asynchronous copy (the buffer is rewritten only after the previous
    step's copy has finished)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._staged: torch.cuda.Event | None = None

    def __call__(self, values: list[int]) -> torch.Tensor:
        """``values`` as one int64 tensor on the device."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        if self._pinned is None or self._pinned.numel() < host.numel():
            self._pinned = torch.empty(max(host.numel(), 1 << 16), dtype=torch.long).pin_memory()
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has left the buffer
        pinned = self._pinned[: host.numel()]
        pinned.copy_(host)
        staged = pinned.to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return staged


class StepBuilder:
    """Builds the `StepInputs` of scheduled batches for one KV cache.

    Args:
        kv_cache: the paged cache the step's keys and values go to.
        device: the model's device.
        dtype: the model's dtype (of the decode masks).
    """

    def __init__(self, kv_cache: KVCache, device: torch.device, dtype: torch.dtype) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.num_groups = len(kv_cache.groups.layers)
        self.dtype = dtype
        self.stage = StepStager(device)
        #: Reused buffers of the attention (gathered keys and values).
        self.workspace: dict[str, torch.Tensor] = {}
        #: Some layer softcaps its attention logits: it attends chunk by chunk even with
        #: a prefill batch.
        self.softcapped = any(spec.softcap is not None for spec in kv_cache.layers)

    def build(
        self, batch: ScheduledBatch, batched_prefill: bool, native_attention: bool
    ) -> StepInputs:
        """The `StepInputs` of ``batch``: single-token requests first, then the prefill
        chunks, attended in one padded call with ``batched_prefill``, and the decodes
        through the native kernel with ``native_attention``."""
        host = _read_requests(batch)
        bs, num_decode, ends = self.block_size, host.num_decode, host.ends
        columns = cdiv(max(ends), bs)
        num_tokens, num_requests = len(host.ids), len(host.scheduled)
        num_sampled = len(host.sample_rows)
        tables = _block_tables(host.scheduled, self.num_groups, columns)
        staged = self.stage([*host.ids, *host.starts, *host.counts, *host.sample_rows, *tables])
        input_ids, rest = staged[:num_tokens], staged[num_tokens:]
        first_pos, n_new = rest[:num_requests], rest[num_requests : 2 * num_requests]
        rest = rest[2 * num_requests :]
        # NO_BLOCK (-1: behind a sliding window, never read unmasked) reads block 0.
        table_t = rest[num_sampled:].view(self.num_groups, num_requests, columns).clamp(min=0)
        positions, first_row, slot_mapping = self._positions_and_slots(
            first_pos, n_new, table_t, num_tokens
        )
        decode_blocks = decode_lengths = None
        decode_lens = [start + 1 for start in host.starts[:num_decode]]
        if num_decode:
            decode_columns = cdiv(max(decode_lens), bs)
            decode_blocks = list(table_t[:, :num_decode, :decode_columns].unbind(0))
            decode_lengths = first_pos[:num_decode] + 1
        prefill_batch = None
        if num_requests > num_decode and batched_prefill:
            prefill_batch = self._prefill_batch(host, table_t, first_pos, n_new, first_row)
        # A chunk's context slots, for the layers that attend chunk by chunk (all of
        # them, or with a prefill batch those with a softcap).
        per_chunk = prefill_batch is None or self.softcapped
        attention = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            num_decode=num_decode,
            decode_blocks=decode_blocks,
            decode_lengths=decode_lengths,
            prefills=self._prefill_spans(host, table_t, per_chunk),
            workspace=self.workspace,
            dtype=self.dtype,
            decode_context_lens=decode_lens,
            prefill_batch=prefill_batch,
            native_attention=native_attention,
        )
        rows = rest[:num_sampled]
        return StepInputs(
            input_ids,
            positions,
            attention,
            rows,
            host.sample_requests,
            host.prompt_rows,
            host.scheduled,
        )

    def _positions_and_slots(
        self, first_pos: torch.Tensor, n_new: torch.Tensor, table_t: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Each packed token's position and cache slots, on the device.

        Args:
            first_pos: int64 ``[R]`` each request's first new position.
            n_new: int64 ``[R]`` each request's new tokens.
            table_t: int64 ``[groups, R, columns]`` block tables (non-negative).
            num_tokens: ``T``, the sum of ``n_new``.

        Returns:
            ``(positions, first_row, slot_mapping)``: int64 ``[T]`` positions, int64
            ``[R]`` each request's first packed row, and per group int64 ``[T]`` slots.
        """
        bs, device = self.block_size, n_new.device
        owner = torch.repeat_interleave(
            torch.arange(len(first_pos), device=device), n_new, output_size=num_tokens
        )
        first_row = torch.cumsum(n_new, 0) - n_new
        positions = first_pos[owner] + torch.arange(num_tokens, device=device) - first_row[owner]
        block_col, offset = positions // bs, positions % bs
        slot_mapping = [table_t[g, owner, block_col] * bs + offset for g in range(self.num_groups)]
        return positions, first_row, slot_mapping

    def _prefill_batch(
        self,
        host: _HostInputs,
        table_t: torch.Tensor,
        first_pos: torch.Tensor,
        n_new: torch.Tensor,
        first_row: torch.Tensor,
    ) -> PrefillBatch:
        """The step's prefill chunks (the requests after the decodes) as one
        `PrefillBatch`; the tensors are per request, as `_positions_and_slots` takes and
        returns them."""
        num_decode = host.num_decode
        return PrefillBatch.build(
            table_t[:, num_decode:],
            first_pos[num_decode:],
            n_new[num_decode:],
            first_row[num_decode:],
            max_new=max(host.counts[num_decode:]),
            max_context=max(host.ends[num_decode:]),
            block_size=self.block_size,
            num_tokens=len(host.ids),
        )

    def _prefill_spans(
        self, host: _HostInputs, table_t: torch.Tensor, per_chunk: bool
    ) -> list[PrefillSpan]:
        """One `PrefillSpan` per chunk, in packed order; with ``per_chunk`` each chunk
        with earlier context gets its context slots (``table_t``: int64 ``[groups,
        requests, columns]`` block tables)."""
        spans = []
        row = host.num_decode
        for index in range(host.num_decode, len(host.scheduled)):
            start, n = host.starts[index], host.counts[index]
            span_slots = None
            if start > 0 and per_chunk:
                span_slots = [
                    context_slots(table_t[g, index], start + n, self.block_size)
                    for g in range(self.num_groups)
                ]
            spans.append(PrefillSpan(start=row, num_new=n, context_len=start + n, slots=span_slots))
            row += n
        return spans
