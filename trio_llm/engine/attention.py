"""Attention over the paged KV cache, plugged into transformers' attention interface.

`paged_attention` runs in every layer with the step's
`trio_llm.engine.attention_metadata.PagedAttentionMetadata` (see `step_metadata`). It
writes the layer's new keys and values into the cache at ``slot_mapping``, then attends:

- the requests with one new token (decode): with the native kernel
  (``torch.ops.trio_llm.paged_attention_decode``, `use_native_attention`) over the cache
  in place; or, on the pure-torch reference path, one request alone over its context's
  keys without a mask, or batched calls of a few requests each: their blocks gathered
  into a small reused workspace ``[b, L_max, H_kv, D]`` (small enough to stay in the CPU
  cache until attention reads it) and masked past each request's length;
- the requests with several new tokens (prefill chunks): on a GPU all together in one
  call over a padded batch (`PrefillBatch`: each chunk's context read from the cache, one
  mask for causality, context length and window); else one by one, causally, over their
  context (straight from the new keys when there is no earlier context; in a
  sliding-window layer, from the first key the chunk's first query sees).

The cache may hold another dtype than the model's (``--kv-cache-dtype``): keys and values
are cast to it as they are written and back to the query's dtype as they are read (the
native kernel reads float32 and bfloat16 caches and computes in float32; float16 takes the
reference path), except a prefill chunk's context on a CPU with native bf16 (`context_dtype`).

Each layer's own attention is kept: its softmax ``scaling``, its ``sliding_window`` (a
query at position ``p`` sees the keys at positions ``p - window + 1 .. p``, as transformers'
sliding-window masks do) and its logit ``softcap`` (``tanh(s / cap) * cap`` before the
mask, as transformers' eager attention does), all read from what the layer passes to the
attention function. `trio_llm.engine.attention_probe.probe_layers` runs the model once at
start-up to learn each layer's key/value shapes and to refuse what this function cannot do.

Registered with ``transformers.AttentionInterface`` under `ATTENTION_NAME`; transformers
builds no attention mask for a name it does not know, which is what we want.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import AttentionInterface

from trio_llm.config import ATTENTION_BACKENDS
from trio_llm.engine import kernels
from trio_llm.engine.attention_metadata import (
    LayerProbe,
    PagedAttentionMetadata,
    PrefillBatch,
    PrefillSpan,
    chunk_mask,
    current_step,
)
from trio_llm.model_files.dtype_choice import context_dtype

logger = logging.getLogger(__name__)

ATTENTION_NAME = "trio_llm_paged"

#: Bytes of gathered keys and values per decode chunk (sized to stay in the L2/L3 cache).
GATHER_CHUNK_BYTES = 4 * 1024 * 1024

#: KV cache dtypes the native decode kernel reads (``paged_attention.cpp``).
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class _Layer:
    """One layer's share of the step: its cache tensors, KV cache group and attention."""

    paged: PagedAttentionMetadata
    #: Its KV cache group (the block tables and slots it reads).
    group: int
    #: Its key and value tensors ``[slots, H_kv, D]``.
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float | None
    window: int | None
    softcap: float | None

    @classmethod
    def of(
        cls,
        paged: PagedAttentionMetadata,
        layer_idx: int,
        scaling: float | None,
        window: int | None,
        softcap: float | None,
    ) -> _Layer:
        """Layer ``layer_idx``'s share of the step ``paged``."""
        cache = paged.kv_cache
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        return cls(paged, cache.group_of[layer_idx], keys, values, scaling, window, softcap)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedAttentionMetadata | LayerProbe | None = None,
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
        paged: the step's `PagedAttentionMetadata` (or the start-up probe, which records
            the layer's call: `trio_llm.engine.attention_probe.AttentionProbe`); by
            default the one `step_metadata` set.
        sliding_window: the layer's window in tokens, or None.
        softcap: the layer's attention logit softcapping, or None.

    Returns:
        ``([1, T, H, D], None)``: the attention output in transformers' expected layout.

    Raises:
        ValueError: called outside `step_metadata` (e.g. ``generate()`` on this model).
    """
    if paged is None:
        paged = current_step()
    if paged is None:
        raise ValueError("paged_attention runs only inside step_metadata (the model runner)")
    if not isinstance(paged, PagedAttentionMetadata):  # the start-up probe
        return paged.record(module, query, key, value, sliding_window, softcap, kwargs)
    layer = _Layer.of(paged, module.layer_idx, scaling, sliding_window, softcap)
    _write_new_keys(layer, key, value)
    q = query[0].transpose(0, 1)  # [T, H, D]
    num_tokens = q.shape[0]
    batch = paged.prefill_batch
    # With a prefill batch, one more row takes its padding queries' outputs.
    rows = num_tokens + (batch is not None)
    out = torch.empty(rows, *q.shape[1:], dtype=query.dtype, device=query.device)
    num_decode = paged.num_decode
    if num_decode:
        _decode(layer, q[:num_decode], out[:num_decode])
    if batch is not None and softcap is None:
        _prefill_batched(layer, batch, q, out)
    else:
        for span in paged.prefills:
            _prefill_chunk(layer, span, q, key, value, out)
    return out[:num_tokens].unsqueeze(0), None


def _write_new_keys(layer: _Layer, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write the layer's new keys and values (``[1, H_kv, T, D]``, the model's dtype) into
    its cache at the step's ``slot_mapping``, cast to the cache's dtype (``index_copy_``
    takes one dtype; the cast is a no-op where they are equal)."""
    slots = layer.paged.slot_mapping[layer.group]
    dtype = layer.keys.dtype
    layer.keys.index_copy_(0, slots, key[0].transpose(0, 1).to(dtype))  # [T, H_kv, D]
    layer.values.index_copy_(0, slots, value[0].transpose(0, 1).to(dtype))


# ------------------------------------------------------------------ decode


def _decode(layer: _Layer, q: torch.Tensor, out: torch.Tensor) -> None:
    """Attend the decode queries ``q`` ``[num_decode, H, D]`` into ``out`` (same shape):
    the native kernel where the step enables it and the cache is on the CPU, else the
    pure-torch reference (one request without a mask, or gathered batches)."""
    paged = layer.paged
    plain = layer.window is None and layer.softcap is None
    if paged.native_attention and not layer.keys.is_cuda:
        _native_decode(layer, q, out)
    elif q.shape[0] == 1 and paged.decode_context_lens and plain:
        _decode_one(layer, q, out)
    else:
        _decode_gathered(layer, q, out)


def _native_decode(layer: _Layer, q: torch.Tensor, out: torch.Tensor) -> None:
    """The decode queries ``q`` ``[num_decode, H, D]`` attended by the native kernel over
    the cache in place (no gather, no mask), written into ``out`` (same shape and dtype)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = q.shape[-1] ** -0.5 if layer.scaling is None else layer.scaling
    torch.ops.trio_llm.paged_attention_decode(
        q,
        layer.keys,
        layer.values,
        layer.paged.decode_blocks[layer.group],
        layer.paged.decode_lengths,
        layer.paged.kv_cache.block_size,
        float(scale),
        0 if layer.window is None else int(layer.window),
        0.0 if layer.softcap is None else float(layer.softcap),
        out,
    )


def _decode_one(layer: _Layer, q: torch.Tensor, out: torch.Tensor) -> None:
    """One request decoding (``q`` ``[1, H, D]``), no window, no softcap: over its
    context's keys (read back in ``q``'s dtype) without padding, so no mask."""
    length = layer.paged.decode_context_lens[0]
    slots = layer.paged.decode_slots(layer.group, length)
    keys = layer.keys.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
    values = layer.values.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys, values, scale=layer.scaling, enable_gqa=True
    )
    out[:1] = o[0].transpose(0, 1)


def _decode_gathered(layer: _Layer, q: torch.Tensor, out: torch.Tensor) -> None:
    """The decode queries ``q`` ``[num_decode, H, D]`` over their blocks gathered a few
    requests at a time (in ``q``'s dtype), masked past each request's length and outside
    its window."""
    k_cache, v_cache, paged = layer.keys, layer.values, layer.paged
    num_decode, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    block_size = paged.kv_cache.block_size
    blocks, mask = paged.decode_view(layer.group, layer.window)
    context = blocks.shape[1] * block_size
    # Grouped-query attention without repeating keys: the `group` query heads that
    # share a KV head become `group` query rows of that head.
    q_decode = q.reshape(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # Gather a few requests at a time so their keys and values are still in the CPU
    # cache when attention reads them (one pass over DRAM instead of three).
    # (A cache of another dtype is gathered, then cast into a second buffer: both count.)
    item_bytes = k_cache.element_size()
    if k_cache.dtype != q.dtype:
        item_bytes += q.element_size()
    row_bytes = 2 * context * num_kv_heads * head_dim * item_bytes
    # On a GPU one gather of every request beats many small launches.
    chunk = num_decode if k_cache.is_cuda else max(1, GATHER_CHUNK_BYTES // row_bytes)
    for start in range(0, num_decode, chunk):
        end = min(num_decode, start + chunk)
        ids = blocks[start:end].reshape(-1)
        keys = _gather_blocks(k_cache, ids, block_size, "k", paged.workspace, q.dtype)
        values = _gather_blocks(v_cache, ids, block_size, "v", paged.workspace, q.dtype)
        keys = keys.view(end - start, context, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(end - start, context, num_kv_heads, head_dim).transpose(1, 2)
        o = attend(q_decode[start:end], keys, values, mask[start:end], layer.scaling, layer.softcap)
        out[start:end] = o.reshape(end - start, num_heads, head_dim)


def _gather_blocks(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    out_name: str,
    ws: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Copy whole blocks ``cache[blocks]`` into a reused buffer of ``dtype``: ``[len(blocks)
    * bs, H, D]``. A cache of another dtype is gathered into a buffer of its own dtype
    first, then cast into the ``dtype`` one (both kept in ``ws``)."""
    row = block_size * cache.shape[1] * cache.shape[2]
    numel = blocks.numel() * row
    gathered = _workspace(ws, out_name, numel, cache.dtype, cache.device)
    out = gathered.view(blocks.numel(), row)
    torch.index_select(cache.view(-1, row), 0, blocks, out=out)
    if dtype != cache.dtype:
        cast = _workspace(ws, f"{out_name}:{dtype}", numel, dtype, cache.device)
        out = cast.view(blocks.numel(), row).copy_(out)
    return out.view(blocks.numel() * block_size, cache.shape[1], cache.shape[2])


def _workspace(
    ws: dict[str, torch.Tensor], name: str, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The first ``numel`` elements of the reused 1-D buffer ``ws[name]`` (``dtype``),
    grown (or made anew for another dtype) when too small."""
    buffer = ws.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        ws[name] = buffer
    return buffer[:numel]


# ------------------------------------------------------------------ prefill


def _prefill_batched(
    layer: _Layer, batch: PrefillBatch, q: torch.Tensor, out: torch.Tensor
) -> None:
    """Every prefill chunk of the step in one call (no softcap): queries ``q`` ``[T, H,
    D]`` over each chunk's context read from the cache (in ``q``'s dtype), into ``out``
    ``[T + 1, H, D]``."""
    slots = batch.key_slots[layer.group]
    o = F.scaled_dot_product_attention(
        q[batch.query_rows].transpose(1, 2),  # [C, H, n_max, D]
        layer.keys[slots].to(q.dtype).transpose(1, 2),  # [C, H_kv, L_max, D]
        layer.values[slots].to(q.dtype).transpose(1, 2),
        attn_mask=batch.mask(layer.window),
        scale=layer.scaling,
        enable_gqa=True,
    )
    out.index_copy_(0, batch.output_rows.view(-1), o.transpose(1, 2).flatten(0, 1))


def _prefill_chunk(
    layer: _Layer,
    span: PrefillSpan,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One prefill chunk's queries (rows ``span.start ..`` of ``q`` ``[T, H, D]``), causal
    over its context: the new keys (``key``/``value`` ``[1, H_kv, T, D]``) when it has no
    earlier context, else its keys read from the cache (in `context_dtype`: ``q``'s, or
    bfloat16 for float32 queries over a bfloat16 cache on a CPU with native bf16)."""
    end = span.start + span.num_new
    q_span = q[span.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if span.slots is None:
        k_span = key[:, :, span.start : end]
        v_span = value[:, :, span.start : end]
        first_key = 0
    else:
        # Keys before the first query's window are never seen: skip them.
        first_key = 0
        if layer.window is not None:
            first_key = max(0, span.context_len - span.num_new - layer.window + 1)
        slots = span.slots[layer.group][first_key:]
        dtype = context_dtype(q.dtype, layer.keys.dtype, q.device)
        q_span = q_span.to(dtype)
        k_span = layer.keys.index_select(0, slots).to(dtype).transpose(0, 1).unsqueeze(0)
        v_span = layer.values.index_select(0, slots).to(dtype).transpose(0, 1).unsqueeze(0)
    if span.slots is None and layer.window is None and layer.softcap is None:
        o = F.scaled_dot_product_attention(
            q_span, k_span, v_span, is_causal=True, scale=layer.scaling, enable_gqa=True
        )
    else:
        mask = chunk_mask(
            span.num_new, span.context_len, first_key, layer.window, q.device, q_span.dtype
        )
        o = attend(q_span, k_span, v_span, mask, layer.scaling, layer.softcap, enable_gqa=True)
    out[span.start : end] = o[0].transpose(0, 1)


# ------------------------------------------------------------------ the reference


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    *,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``q`` ``[..., H, n, D]`` over ``k``/``v`` ``[..., H_kv, L,
    D]`` with a broadcastable mask (additive, or boolean with True = visible); the logits
    are softcapped first when ``softcap`` is set, in the order of transformers' eager
    attention (scale, cap, mask, float32 softmax).

    With ``enable_gqa``, ``q`` is ``[1, H, n, D]`` over ``[1, H_kv, L, D]`` (grouped query
    heads: head ``h`` reads KV head ``h // (H / H_kv)``); else ``H == H_kv``. Returns
    ``q``'s shape.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa
        )
    if enable_gqa:
        _, num_heads, n, head_dim = q.shape
        num_kv_heads = k.shape[1]
        q5 = q.view(1, num_kv_heads, num_heads // num_kv_heads, n, head_dim)
        o = attend(q5, k.unsqueeze(2), v.unsqueeze(2), mask, scaling, softcap)
        return o.view(1, num_heads, n, head_dim)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -torch.inf)
    else:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


# ------------------------------------------------------------------ start-up


def use_native_attention(
    backend: str, device: torch.device, kv_dtype: torch.dtype = torch.float32
) -> bool:
    """Whether the decode attention runs the native kernel, for ``--attention-backend``;
    loads (building if missing) the kernels and logs once which path runs. Call it at
    start-up, never per step.

    Args:
        backend: one of `ATTENTION_BACKENDS`: ``auto`` (the native kernel where it loads,
            the cache is on the CPU and of a dtype it reads), ``CPU_ATTN`` (require it),
            ``TORCH_SDPA`` (the pure-torch reference path).
        device: where the KV cache lives (the kernels are CPU only).
        kv_dtype: the KV cache's dtype (``--kv-cache-dtype``); the kernel reads
            `NATIVE_KV_DTYPES` (float32, bfloat16), so a float16 cache takes the
            reference path.

    Raises:
        ValueError: ``CPU_ATTN`` where the kernels did not load, the cache is on a GPU or
            of a dtype the kernel does not read, or an unknown ``backend``.
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
    if kv_dtype not in NATIVE_KV_DTYPES:
        name = str(kv_dtype).removeprefix("torch.")
        if backend == "CPU_ATTN":
            raise ValueError(
                f"--attention-backend CPU_ATTN reads a float32 or bfloat16 KV cache, not "
                f"{name} (--kv-cache-dtype)"
            )
        logger.info(
            f"attention: pure-torch reference path (the native kernel reads no {name} KV cache)"
        )
        return False
    status = kernels.load()
    if backend == "CPU_ATTN" and not status.loaded:
        raise ValueError(f"--attention-backend CPU_ATTN: the native kernels: {status.detail}")
    logger.info(status.describe())
    return status.loaded


AttentionInterface.register(ATTENTION_NAME, paged_attention)
