"""Per-step attention metadata: where the step's tokens live in the paged KV cache.

The model runner packs every scheduled token of every request into one sequence of
length ``T`` (batch dimension 1): the decodes (one new token each) first, then the
prefill chunks. It builds one `PagedAttentionMetadata` per step and runs the decoder
inside `step_metadata`, which makes it visible to
`trio_llm.engine.attention.paged_attention` in every layer (a context variable rather
than a keyword argument, because some families' layers do not pass their keyword
arguments on to the attention). At start-up a `LayerProbe` takes its place for one
forward pass (`trio_llm.engine.attention_probe`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trio_llm.engine.block_manager import cdiv
from trio_llm.engine.kv_cache import KVCache, context_slots


@dataclass
class PrefillSpan:
    """One request's chunk of new tokens inside the packed sequence.

    Attributes:
        start: index of its first new token in the packed sequence.
        num_new: number of new (query) tokens.
        context_len: tokens attended to, earlier ones included (``>= num_new``).
        slots: per KV cache group, the cache slots of all ``context_len`` tokens (int64
            ``[context_len]``; behind a sliding window, where the group holds no block,
            slots of block 0 that are never read), or None when ``context_len ==
            num_new`` (keys are taken from the new ones) or when the step's
            `PrefillBatch` serves every layer (none softcaps).
    """

    start: int
    num_new: int
    context_len: int
    slots: list[torch.Tensor] | None


@dataclass
class PrefillBatch:
    """A step's prefill chunks as one padded batch, attended in one call per layer.

    ``C`` chunks, the longest ``n_max`` new tokens and ``L_max`` tokens of context. Query
    ``j`` of chunk ``c`` is packed row ``query_rows[c, j]`` (padded queries read row 0);
    it sits at position ``query_pos[c, j]`` and sees the keys of its request at positions
    ``0 .. query_pos`` (within a layer's sliding window), read from the cache at
    ``key_slots``: the new keys are written there first. Its output goes to packed row
    ``output_rows[c, j]``, which is ``T`` (one row past the packed tokens, dropped) for
    padding: no boolean indexing, so no wait for the device.

    Attributes:
        query_rows: int64 ``[C, n_max]`` packed rows of the queries.
        output_rows: int64 ``[C, n_max]`` where each query's output goes.
        query_pos: int64 ``[C, n_max]`` positions of the queries.
        key_slots: per KV cache group, int64 ``[C, L_max]`` cache slots of positions
            ``0 .. L_max - 1`` (past a chunk's context: slots of block 0, masked).
    """

    query_rows: torch.Tensor
    output_rows: torch.Tensor
    query_pos: torch.Tensor
    key_slots: list[torch.Tensor]
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,
        starts: torch.Tensor,
        num_new: torch.Tensor,
        first_rows: torch.Tensor,
        max_new: int,
        max_context: int,
        block_size: int,
        num_tokens: int,
    ) -> PrefillBatch:
        """The batch of ``C`` chunks, with tensor operations on their device.

        Args:
            tables: int64 ``[groups, C, columns]`` block tables (non-negative), with
                ``columns * block_size >= max_context``.
            starts: int64 ``[C]`` each chunk's first position (tokens already computed).
            num_new: int64 ``[C]`` each chunk's new tokens.
            first_rows: int64 ``[C]`` each chunk's first packed row.
            max_new: ``max(num_new)``.
            max_context: ``max(starts + num_new)``.
            block_size: tokens per KV block.
            num_tokens: ``T``, the packed tokens of the step.
        """
        device = tables.device
        offsets = torch.arange(max_new, device=device)
        valid = offsets < num_new[:, None]
        rows = first_rows[:, None] + offsets
        key_pos = torch.arange(max_context, device=device)
        block_col, key_offset = key_pos // block_size, key_pos % block_size
        slots = [table[:, block_col] * block_size + key_offset for table in tables.unbind(0)]
        return cls(
            torch.where(valid, rows, 0),
            torch.where(valid, rows, num_tokens),
            starts[:, None] + offsets,
            slots,
        )

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean ``[C, 1, n_max, L_max]`` (True: visible) for a layer with sliding
        ``window`` (or None), built once per step and window."""
        mask = self._masks.get(window)
        if mask is None:
            key_pos = torch.arange(self.key_slots[0].shape[1], device=self.query_pos.device)
            query_pos = self.query_pos[:, :, None]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            mask = mask[:, None]
            self._masks[window] = mask
        return mask


@dataclass
class PagedAttentionMetadata:
    """Where this step's tokens live in the cache; the same object serves every layer.

    Attributes:
        kv_cache: the cache to read and write.
        slot_mapping: per KV cache group, int64 ``[T]``: the cache slot of each packed
            token.
        num_decode: the first ``num_decode`` packed tokens are single-token requests.
        decode_blocks: per KV cache group, int64 ``[num_decode, max_blocks]``: each decode
            request's block table padded with block 0 to ``max_blocks`` entries (block 0
            also stands where a sliding-window group holds no block; masked).
        decode_lengths: int64 ``[num_decode]``, each decode request's context length
            (tokens, its new one included).
        prefills: the multi-token chunks, in packed order after the decodes.
        workspace: reused buffers for gathered keys/values (grown on demand).
        dtype: the model's dtype (of the additive decode masks).
        native_attention: attend the decodes with the native kernel
            (``torch.ops.trio_llm.paged_attention_decode``, `use_native_attention`) where
            the cache is on the CPU; False runs the pure-torch reference path.
    """

    kv_cache: KVCache
    slot_mapping: list[torch.Tensor]
    num_decode: int
    decode_blocks: list[torch.Tensor] | None
    decode_lengths: torch.Tensor | None
    prefills: list[PrefillSpan]
    workspace: dict[str, torch.Tensor]
    dtype: torch.dtype = torch.float32
    native_attention: bool = False
    #: ``decode_lengths`` as Python ints (no device sync to read them); empty: not given
    #: (one decoding request then takes the padded, masked path too).
    decode_context_lens: list[int] = field(default_factory=list)
    #: The prefill chunks as one batch (attended in one call), or None (one call each).
    prefill_batch: PrefillBatch | None = None
    _decode_slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _decode_views: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    def decode_slots(self, group: int, length: int) -> torch.Tensor:
        """The cache slots of the first decode request's ``length`` context tokens in KV
        cache group ``group`` (int64 ``[length]``), built once per step and group."""
        slots = self._decode_slots.get(group)
        if slots is None:
            table = self.decode_blocks[group][0]
            slots = context_slots(table, length, self.kv_cache.block_size)
            self._decode_slots[group] = slots
        return slots

    def decode_view(self, group: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of KV cache group ``group`` the decode requests attend to and their
        additive mask, built once per step, group and window and shared by the layers.

        Returns:
            ``(blocks, mask)``: int64 ``[num_decode, columns]`` block ids (the whole
            padded table, or with a ``window`` only the blocks that overlap it) and the
            ``[num_decode, 1, 1, columns * block_size]`` mask (model dtype): 0 where the
            key is inside the request's context and within ``window`` tokens of its new
            token, -inf elsewhere.
        """
        view = self._decode_views.get((group, window))
        if view is None:
            bs = self.kv_cache.block_size
            table = self.decode_blocks[group]
            lengths = self.decode_lengths[:, None]
            columns = torch.arange(table.shape[1], device=table.device)[None, :]
            if window is not None and cdiv(window, bs) + 1 < table.shape[1]:
                first = (lengths - window).clamp(min=0) // bs
                columns = first + columns[:, : cdiv(window, bs) + 1]
                # Past the table: a repeated last block, masked (its positions >= length).
                table = table.gather(1, columns.clamp(max=table.shape[1] - 1))
            offsets = torch.arange(bs, device=table.device)
            key_pos = (columns[:, :, None] * bs + offsets).expand(table.shape[0], -1, -1)
            key_pos = key_pos.reshape(table.shape[0], -1)
            hidden = key_pos >= lengths
            if window is not None:
                hidden |= key_pos < lengths - window
            mask = torch.zeros(hidden.shape, dtype=self.dtype, device=table.device)
            view = table, mask.masked_fill_(hidden, -torch.inf)[:, None, None]
            self._decode_views[group, window] = view
        return view


class LayerProbe(Protocol):
    """What runs in place of the attention during the start-up probe
    (`trio_llm.engine.attention_probe.AttentionProbe`): each layer's call is recorded."""

    def record(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """Record one layer's call (`paged_attention`'s module, query, key, value, window,
        softcap and other arguments); returns zeros of the attention output's shape."""
        ...


_STEP: ContextVar[PagedAttentionMetadata | LayerProbe | None] = ContextVar(
    "trio_llm_paged_step", default=None
)


@contextmanager
def step_metadata(metadata: PagedAttentionMetadata | LayerProbe) -> Iterator[None]:
    """Make ``metadata`` the one `paged_attention` uses for the forward passes inside."""
    token = _STEP.set(metadata)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step() -> PagedAttentionMetadata | LayerProbe | None:
    """The metadata `step_metadata` set, or None outside it."""
    return _STEP.get()


@functools.lru_cache(maxsize=4)
def chunk_mask(
    num_queries: int,
    context_len: int,
    first_key: int,
    window: int | None,
    device: torch.device,
    dtype: torch.dtype = torch.bool,
) -> torch.Tensor:
    """``[q, k]`` mask of a chunk whose queries are the last ``num_queries`` of
    ``context_len`` positions, over the keys at positions ``first_key .. context_len - 1``:
    query ``i`` (position ``p``) sees keys ``max(0, p - window + 1) .. p``. Boolean (True
    = visible), or additive in a floating ``dtype`` (0 visible, -inf hidden: what
    ``scaled_dot_product_attention`` turns a boolean mask into at every call).

    Cached (the last few): every layer of a step asks for the same one; callers never
    write to it.
    """
    query_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    key_pos = torch.arange(first_key, context_len, device=device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    if dtype == torch.bool:
        return visible
    hidden = torch.full(visible.shape, -torch.inf, dtype=dtype, device=device)
    return hidden.masked_fill_(visible, 0.0)
