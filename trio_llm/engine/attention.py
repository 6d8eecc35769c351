"""Attention over the paged KV cache, plugged into transformers' attention interface.

The model runner packs every scheduled token of every request into one sequence of
length ``T`` (batch dimension 1) and runs the decoder inside `step_metadata`, which makes
a `PagedAttentionMetadata` visible to `paged_attention` in every layer (a context
variable rather than a keyword argument, because some families' layers do not pass their
keyword arguments on to the attention). There,
the layer's new keys and values are written into the cache at ``slot_mapping``, then:

- requests with one new token (decode) are attended in batched calls of a few requests
  each: their blocks are gathered into a small reused workspace ``[b, L_max, H_kv, D]``
  (small enough to stay in the CPU cache until attention reads it) and masked past each
  request's length;
- requests with several new tokens (prefill chunks) are attended one by one, causally,
  over their context (straight from the new keys when there is no earlier context; in a
  sliding-window layer, from the first key the chunk's first query sees); or, on a GPU,
  all together in one call over a padded batch (`PrefillBatch`: each chunk's context
  read from the cache, one mask for causality, context length and window).

Each layer's own attention is kept: its softmax ``scaling``, its ``sliding_window`` (a
query at position ``p`` sees the keys at positions ``p - window + 1 .. p``, as transformers'
sliding-window masks do) and its logit ``softcap`` (``tanh(s / cap) * cap`` before the
mask, as transformers' eager attention does), all read from what the layer passes to the
attention function. `probe_layers` runs the model once at start-up to learn each layer's
key/value shapes from its actual projections and to refuse what this function cannot do.

Registered with ``transformers.AttentionInterface`` under `ATTENTION_NAME`; transformers
builds no attention mask for a name it does not know, which is what we want.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers import AttentionInterface

from trio_llm.config import ATTENTION_BACKENDS
from trio_llm.engine import kernels
from trio_llm.engine.block_manager import cdiv

logger = logging.getLogger(__name__)

ATTENTION_NAME = "trio_llm_paged"

#: Bytes of gathered keys and values per decode chunk (sized to stay in the L2/L3 cache).
GATHER_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer keeps in the cache and how it attends, from `probe_layers`.

    Attributes:
        num_kv_heads: key/value heads of the layer's projections.
        head_dim: size of each key/value head.
        sliding_window: tokens a query sees (itself included), or None for the whole context.
        softcap: attention logit softcapping, or None.
    """

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class KVGroups:
    """How the layers share the KV cache (vLLM's hybrid KV cache manager).

    Layers are split into groups of equal size, each group of one kind (full attention,
    or one sliding window); each group has its own block table per request
    (`trio_llm.engine.block_manager.BlockManager`). Slot ``j`` of every group shares one
    physical tensor, so a block id addresses slot ``j`` of each layer of a group.

    Attributes:
        layers: per group, its layer indices (``layer_idx``), in order.
        windows: per group, its sliding window in tokens, or None (every block kept).
    """

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @classmethod
    def plan(cls, specs: Sequence[LayerSpec], max_model_len: int, hybrid: bool = True) -> KVGroups:
        """Group ``specs`` (one per layer).

        Args:
            specs: what `probe_layers` found.
            max_model_len: a window at least this long never binds: full attention.
            hybrid: False puts every layer in one group that keeps every block (vLLM's
                ``--disable-hybrid-kv-cache-manager``).

        Returns:
            One group when every layer is of the same kind (a window group if they share
            a window that binds), when ``hybrid`` is False, or when the layers' key/value
            shapes differ; else groups of ``gcd`` of the kinds' layer counts.
        """
        windows = [
            spec.sliding_window
            if spec.sliding_window is not None and spec.sliding_window < max_model_len
            else None
            for spec in specs
        ]
        every = tuple(range(len(specs)))
        kinds = list(dict.fromkeys(windows))
        if len(kinds) == 1 and hybrid:
            return cls((every,), (kinds[0],))
        shapes = {(spec.num_kv_heads, spec.head_dim) for spec in specs}
        if not hybrid or len(shapes) > 1:
            return cls((every,), (None,))
        members = {kind: [i for i in every if windows[i] == kind] for kind in kinds}
        size = math.gcd(*(len(layers) for layers in members.values()))
        groups, group_windows = [], []
        for kind in kinds:
            layers = members[kind]
            for start in range(0, len(layers), size):
                groups.append(tuple(layers[start : start + size]))
                group_windows.append(kind)
        return cls(tuple(groups), tuple(group_windows))

    @property
    def group_size(self) -> int:
        """Layers per group (slots of the physical tensors)."""
        return len(self.layers[0])


class KVCache:
    """Key and value tensors shared by the KV cache groups.

    Slot ``j`` of every group is one pair of tensors ``[(num_blocks + 1) * block_size,
    num_kv_heads, head_dim]`` (the shape of the layers in that slot). Layer ``l`` of
    group ``g`` reads and writes at ``block_id * block_size + offset`` with ``g``'s
    block table. One more block past the pool, never in a block table, is scratch space:
    the padding rows of a CUDA graph's batch write their keys there (`scratch_slot`).
    Memory: `bytes_per_block` ``* (num_blocks + 1)`` bytes, allocated once on ``device``.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        groups: KVGroups,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """
        Args:
            layers: one spec per layer, indexed by ``layer_idx`` (`probe_layers`).
            groups: how the layers share the cache (`KVGroups.plan`).
            num_blocks: blocks in the pool (each ``block_size`` tokens of one group's
                layers).
            block_size: tokens per block.
            dtype: of the keys and values (the model's).
            device: where the tensors live.
        """
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = tuple(layers)
        self.groups = groups
        slots = [layers[i] for i in groups.layers[0]]
        #: A cache slot outside every block table (in the scratch block).
        self.scratch_slot = num_blocks * block_size
        rows = (num_blocks + 1) * block_size
        shapes = [(rows, spec.num_kv_heads, spec.head_dim) for spec in slots]
        keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        #: Per layer (``layer_idx``): its group, and its key and value tensors.
        self.group_of = [0] * len(layers)
        self.keys: list[torch.Tensor] = [keys[0]] * len(layers)
        self.values: list[torch.Tensor] = [values[0]] * len(layers)
        for group, members in enumerate(groups.layers):
            for slot, layer in enumerate(members):
                self.group_of[layer] = group
                self.keys[layer] = keys[slot]
                self.values[layer] = values[slot]

    @staticmethod
    def bytes_per_block(
        layers: Sequence[LayerSpec], groups: KVGroups, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes: keys and values of one group's layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        slots = [layers[i] for i in groups.layers[0]]
        per_token = sum(spec.num_kv_heads * spec.head_dim for spec in slots)
        return 2 * block_size * per_token * itemsize


def context_slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache slots (int64 ``[length]``) of positions ``0 .. length - 1`` of a request
    whose block table is ``table`` (int64 ``[columns]``, non-negative, covering them)."""
    positions = torch.arange(length, device=table.device)
    return table[positions // block_size] * block_size + positions % block_size


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


_STEP: ContextVar[PagedAttentionMetadata | AttentionProbe | None] = ContextVar(
    "trio_llm_paged_step", default=None
)


@contextmanager
def step_metadata(metadata: PagedAttentionMetadata | AttentionProbe) -> Iterator[None]:
    """Make ``metadata`` the one `paged_attention` uses for the forward passes inside."""
    token = _STEP.set(metadata)
    try:
        yield
    finally:
        _STEP.reset(token)


def use_native_attention(backend: str, device: torch.device) -> bool:
    """Whether the decode attention runs the native kernel, for ``--attention-backend``;
    loads (building if missing) the kernels and logs once which path runs. Call it at
    start-up, never per step.

    Args:
        backend: one of `ATTENTION_BACKENDS`: ``auto`` (the native kernel where it loads
            and the cache is on the CPU), ``CPU_ATTN`` (require it), ``TORCH_SDPA`` (the
            pure-torch reference path).
        device: where the KV cache lives (the kernels are CPU only).

    Raises:
        ValueError: ``CPU_ATTN`` where the kernels did not load or the cache is on a GPU,
            or an unknown ``backend``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "TORCH_SDPA":
        logger.info("attention: pure-torch reference path (--attention-backend TORCH_SDPA)")
        return False
    if device.type != "cpu":
        if backend == "CPU_ATTN":
            raise ValueError("--attention-backend CPU_ATTN runs on the CPU only")
        return False
    status = kernels.load()
    if backend == "CPU_ATTN" and not status.loaded:
        raise ValueError(f"--attention-backend CPU_ATTN: the native kernels: {status.detail}")
    logger.info(status.describe())
    return status.loaded


def _gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out_name: str, ws: dict
) -> torch.Tensor:
    """Copy whole blocks ``cache[blocks]`` into a reused buffer: ``[len(blocks) * bs, H, D]``."""
    row = block_size * cache.shape[1] * cache.shape[2]
    numel = blocks.numel() * row
    buffer = ws.get(out_name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype:
        buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        ws[out_name] = buffer
    out = buffer[:numel].view(blocks.numel(), row)
    torch.index_select(cache.view(-1, row), 0, blocks, out=out)
    return out.view(blocks.numel() * block_size, cache.shape[1], cache.shape[2])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedAttentionMetadata | AttentionProbe | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer over the paged cache (transformers' attention signature).

    Args:
        module: the attention module; its ``layer_idx`` selects the cache layer.
        query: ``[1, H, T, D]`` after rotary embedding.
        key, value: ``[1, H_kv, T, D]`` for the new tokens.
        attention_mask: ignored (None: the layout comes from ``paged``).
        scaling: softmax scale, usually ``D ** -0.5``.
        paged: the step's `PagedAttentionMetadata` (or the start-up `AttentionProbe`);
            by default the one `step_metadata` set.
        sliding_window: the layer's window in tokens, or None.
        softcap: the layer's attention logit softcapping, or None.

    Returns:
        ``([1, T, H, D], None)``: the attention output in transformers' expected layout.

    Raises:
        ValueError: called outside `step_metadata` (e.g. ``generate()`` on this model).
    """
    if paged is None:
        paged = _STEP.get()
    if isinstance(paged, AttentionProbe):
        return paged.record(module, query, key, value, sliding_window, softcap, kwargs)
    if paged is None:
        raise ValueError("paged_attention runs only inside step_metadata (the model runner)")
    layer = module.layer_idx
    kv_group = paged.kv_cache.group_of[layer]
    k_cache = paged.kv_cache.keys[layer]
    v_cache = paged.kv_cache.values[layer]
    new_k = key[0].transpose(0, 1)  # [T, H_kv, D]
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, paged.slot_mapping[kv_group], new_k)
    v_cache.index_copy_(0, paged.slot_mapping[kv_group], new_v)

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    q = query[0].transpose(0, 1)  # [T, H, D]
    batch = paged.prefill_batch
    # With a prefill batch, one more row takes its padding queries' outputs.
    rows = num_tokens + (batch is not None)
    out = torch.empty(rows, num_heads, head_dim, dtype=query.dtype, device=query.device)

    num_decode = paged.num_decode
    single = num_decode == 1 and bool(paged.decode_context_lens)
    if num_decode and paged.native_attention and not k_cache.is_cuda:
        _native_decode(
            paged,
            kv_group,
            q[:num_decode],
            k_cache,
            v_cache,
            out[:num_decode],
            scaling,
            sliding_window,
            softcap,
        )
    elif single and sliding_window is None and softcap is None:
        # One request decoding: its context's keys without padding, so no mask.
        length = paged.decode_context_lens[0]
        slots = paged.decode_slots(kv_group, length)
        keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q[:1].transpose(0, 1).unsqueeze(0), keys, values, scale=scaling, enable_gqa=True
        )
        out[:1] = o[0].transpose(0, 1)
    elif num_decode:
        block_size = paged.kv_cache.block_size
        blocks, mask = paged.decode_view(kv_group, sliding_window)
        context = blocks.shape[1] * block_size
        # Grouped-query attention without repeating keys: the `group` query heads that
        # share a KV head become `group` query rows of that head.
        q_decode = q[:num_decode].reshape(num_decode, num_kv_heads, group, head_dim)
        # Gather a few requests at a time so their keys and values are still in the CPU
        # cache when attention reads them (one pass over DRAM instead of three).
        row_bytes = 2 * context * num_kv_heads * head_dim * k_cache.element_size()
        # On a GPU one gather of every request beats many small launches.
        chunk = num_decode if k_cache.is_cuda else max(1, GATHER_CHUNK_BYTES // row_bytes)
        for start in range(0, num_decode, chunk):
            end = min(num_decode, start + chunk)
            ids = blocks[start:end].reshape(-1)
            keys = _gather_blocks(k_cache, ids, block_size, "k", paged.workspace)
            values = _gather_blocks(v_cache, ids, block_size, "v", paged.workspace)
            keys = keys.view(end - start, context, num_kv_heads, head_dim).transpose(1, 2)
            values = values.view(end - start, context, num_kv_heads, head_dim).transpose(1, 2)
            o = _attend(q_decode[start:end], keys, values, mask[start:end], scaling, softcap)
            out[start:end] = o.reshape(end - start, num_heads, head_dim)

    if batch is not None and softcap is None:
        slots = batch.key_slots[kv_group]
        o = F.scaled_dot_product_attention(
            q[batch.query_rows].transpose(1, 2),  # [C, H, n_max, D]
            k_cache[slots].transpose(1, 2),  # [C, H_kv, L_max, D]
            v_cache[slots].transpose(1, 2),
            attn_mask=batch.mask(sliding_window),
            scale=scaling,
            enable_gqa=True,
        )
        out.index_copy_(0, batch.output_rows.view(-1), o.transpose(1, 2).flatten(0, 1))
        return out[:num_tokens].unsqueeze(0), None
    for span in paged.prefills:
        end = span.start + span.num_new
        q_span = q[span.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.slots is None:
            k_span = key[:, :, span.start : end]
            v_span = value[:, :, span.start : end]
            first_key = 0
        else:
            # Keys before the first query's window are never seen: skip them.
            first_key = 0
            if sliding_window is not None:
                first_key = max(0, span.context_len - span.num_new - sliding_window + 1)
            slots = span.slots[kv_group][first_key:]
            k_span = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            v_span = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        if span.slots is None and sliding_window is None and softcap is None:
            o = F.scaled_dot_product_attention(
                q_span, k_span, v_span, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            mask = _chunk_mask(
                span.num_new, span.context_len, first_key, sliding_window, query.device
            )
            o = _attend_grouped(q_span, k_span, v_span, mask, scaling, softcap)
        out[span.start : end] = o[0].transpose(0, 1)
    return out[:num_tokens].unsqueeze(0), None


def _native_decode(
    paged: PagedAttentionMetadata,
    kv_group: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """The decode queries ``q`` ``[num_decode, H, D]`` attended by the native kernel over
    the cache in place (no gather, no mask), written into ``out`` (same shape and dtype)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    torch.ops.trio_llm.paged_attention_decode(
        q,
        k_cache,
        v_cache,
        paged.decode_blocks[kv_group],
        paged.decode_lengths,
        paged.kv_cache.block_size,
        float(scale),
        0 if sliding_window is None else int(sliding_window),
        0.0 if softcap is None else float(softcap),
        out,
    )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v`` with a broadcastable mask (additive, or
    boolean with True = visible); the logits are softcapped first when ``softcap`` is set,
    in the order of transformers' eager attention (scale, cap, mask, float32 softmax)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -torch.inf)
    else:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _attend_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """`_attend` for ``q`` ``[1, H, n, D]`` over ``k``/``v`` ``[1, H_kv, L, D]`` (grouped
    query heads: head ``h`` reads KV head ``h // (H / H_kv)``) with a boolean ``[n, L]``
    mask. Returns ``[1, H, n, D]``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    _, num_heads, n, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q5 = q.view(1, num_kv_heads, num_heads // num_kv_heads, n, head_dim)
    o = _attend(q5, k.unsqueeze(2), v.unsqueeze(2), mask, scaling, softcap)
    return o.view(1, num_heads, n, head_dim)


def _chunk_mask(
    num_queries: int,
    context_len: int,
    first_key: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean ``[q, k]`` mask of a chunk whose queries are the last ``num_queries`` of
    ``context_len`` positions, over the keys at positions ``first_key .. context_len - 1``:
    query ``i`` (position ``p``) sees keys ``max(0, p - window + 1) .. p``."""
    query_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    key_pos = torch.arange(first_key, context_len, device=device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


#: Keyword arguments layers pass to the attention function that `paged_attention` may
#: ignore (they matter only to other kernels, to training, or carry our own metadata).
IGNORED_ATTENTION_KWARGS = frozenset(
    {"dropout", "position_ids", "paged", "output_attentions", "is_causal", "use_cache"}
)


@dataclass
class AttentionProbe:
    """Set by `step_metadata` for a one-token forward pass at start-up: each layer records
    its `LayerSpec` instead of attending (see `probe_layers`).

    Attributes:
        layers: ``layer_idx`` → the layer's spec, in call order.
        problems: why a layer cannot be served by `paged_attention`, one line each.
    """

    layers: dict[int, LayerSpec] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sliding_window: int | None,
        softcap: float | None,
        kwargs: dict[str, object],
    ) -> tuple[torch.Tensor, None]:
        """Record one layer's call; returns zeros of the attention output's shape."""
        layer = getattr(module, "layer_idx", None)
        name = type(module).__name__
        if not isinstance(layer, int):
            self.problems.append(f"{name} has no integer layer_idx")
        elif layer in self.layers:
            self.problems.append(f"layer {layer} attends twice in one forward pass")
        if key.shape[1:] != value.shape[1:] or key.shape[-1] != query.shape[-1]:
            self.problems.append(
                f"{name}: keys {tuple(key.shape)}, values {tuple(value.shape)} and "
                f"queries {tuple(query.shape)} differ in shape (only equal head sizes are "
                "implemented)"
            )
        if query.shape[1] % key.shape[1]:
            self.problems.append(f"{name}: {query.shape[1]} query heads over {key.shape[1]}")
        for arg, value_ in kwargs.items():
            if arg == "s_aux" and value_ is not None:
                self.problems.append(f"{name} uses attention sinks (not implemented)")
            elif arg == "is_causal" and value_ is False:
                self.problems.append(f"{name} attends bidirectionally (is_causal=False)")
            elif arg not in IGNORED_ATTENTION_KWARGS and value_ is not None:
                self.problems.append(f"{name} passes {arg}={value_!r}, which is not implemented")
        if isinstance(layer, int):
            self.layers[layer] = LayerSpec(
                num_kv_heads=key.shape[1],
                head_dim=key.shape[-1],
                sliding_window=None if sliding_window is None else int(sliding_window),
                softcap=None if softcap is None else float(softcap),
            )
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        return out, None


@torch.inference_mode()
def probe_layers(
    decoder: torch.nn.Module, num_layers: int, device: torch.device
) -> list[LayerSpec]:
    """Learn every attention layer's `LayerSpec` from one forward pass of one token.

    Args:
        decoder: the model's decoder (``model.get_decoder()``), loaded with
            ``attn_implementation=ATTENTION_NAME``.
        num_layers: decoder layers the configuration declares.
        device: where the model lives.

    Returns:
        One spec per layer, indexed by ``layer_idx`` (``0 .. num_layers - 1``).

    Raises:
        ValueError: why this model's attention cannot be served by `paged_attention`:
            no layer called it (its attention does not go through transformers' attention
            interface), some layers have none (recurrent or hybrid layers), or a layer
            needs what is not implemented (attention sinks, bidirectional attention,
            unequal key/value head sizes, unknown arguments).
    """
    probe = AttentionProbe()
    with step_metadata(probe):
        decoder(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            use_cache=False,
        )
    if not probe.layers and not probe.problems:
        raise ValueError("its attention does not go through transformers' attention interface")
    if probe.problems:
        raise ValueError("; ".join(dict.fromkeys(probe.problems)))
    missing = sorted(set(range(num_layers)) - set(probe.layers))
    if missing:
        raise ValueError(
            f"layers {missing} of {num_layers} do not attend through transformers' attention "
            "interface (recurrent or hybrid layers are not implemented)"
        )
    if len(probe.layers) != num_layers:
        raise ValueError(
            f"attention layers {sorted(probe.layers)} do not match the {num_layers} decoder "
            "layers its configuration declares"
        )
    return [probe.layers[i] for i in range(num_layers)]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
