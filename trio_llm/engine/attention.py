"""Attention over the paged KV cache, plugged into transformers' attention interface.

The model runner packs every scheduled token of every request into one sequence of
length ``T`` (batch dimension 1) and passes a `PagedAttentionMetadata` as the keyword
argument ``paged``; transformers forwards it to `paged_attention` in every layer. There,
the layer's new keys and values are written into the cache at ``slot_mapping``, then:

- requests with one new token (decode) are attended in batched calls of a few requests
  each: their blocks are gathered into a small reused workspace ``[b, L_max, H_kv, D]``
  (small enough to stay in the CPU cache until attention reads it) and masked past each
  request's length;
- requests with several new tokens (prefill chunks) are attended one by one, causally,
  over their whole context (straight from the new keys when there is no earlier context).

Registered with ``transformers.AttentionInterface`` under `ATTENTION_NAME`; transformers
builds no attention mask for a name it does not know, which is what we want.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "trio_llm_paged"

#: Bytes of gathered keys and values per decode chunk (sized to stay in the L2/L3 cache).
GATHER_CHUNK_BYTES = 4 * 1024 * 1024


class KVCache:
    """Per-layer key and value tensors of shape ``[num_blocks * block_size, H_kv, D]``.

    A slot is ``block_id * block_size + offset``. Memory: ``2 * layers * num_blocks *
    block_size * H_kv * D * itemsize`` bytes, allocated once on ``device``.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass
class PrefillSpan:
    """One request's chunk of new tokens inside the packed sequence.

    Attributes:
        start: index of its first new token in the packed sequence.
        num_new: number of new (query) tokens.
        context_len: tokens attended to, earlier ones included (``>= num_new``).
        slots: cache slots of all ``context_len`` tokens (int64 ``[context_len]``), or
            None when ``context_len == num_new`` (keys are taken from the new ones).
    """

    start: int
    num_new: int
    context_len: int
    slots: torch.Tensor | None


@dataclass
class PagedAttentionMetadata:
    """Where this step's tokens live in the cache; the same object serves every layer.

    Attributes:
        kv_cache: the cache to read and write.
        slot_mapping: int64 ``[T]``, cache slot of each packed token.
        num_decode: the first ``num_decode`` packed tokens are single-token requests.
        decode_blocks: int64 ``[num_decode * max_blocks]``, each decode request's block
            table padded with block 0 to ``max_blocks`` entries (row-major).
        decode_mask: ``[num_decode, 1, 1, max_blocks * block_size]`` in the model dtype;
            0 where a key position is inside the request's context, -inf past it.
        prefills: the multi-token chunks, in packed order after the decodes.
        workspace: reused buffers for gathered keys/values (grown on demand).
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    num_decode: int
    decode_blocks: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    workspace: dict[str, torch.Tensor]


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
    paged: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer over the paged cache (transformers' attention signature).

    Args:
        module: the attention module; its ``layer_idx`` selects the cache layer.
        query: ``[1, H, T, D]`` after rotary embedding.
        key, value: ``[1, H_kv, T, D]`` for the new tokens.
        attention_mask: ignored (None: the layout comes from ``paged``).
        scaling: softmax scale, usually ``D ** -0.5``.
        paged: the step's `PagedAttentionMetadata`.

    Returns:
        ``([1, T, H, D], None)``: the attention output in transformers' expected layout.

    Raises:
        ValueError: called without ``paged`` metadata (e.g. ``generate()`` on this model).
    """
    if paged is None:
        raise ValueError("paged_attention needs the `paged` metadata from the model runner")
    layer = module.layer_idx
    k_cache = paged.kv_cache.keys[layer]
    v_cache = paged.kv_cache.values[layer]
    new_k = key[0].transpose(0, 1)  # [T, H_kv, D]
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, paged.slot_mapping, new_k)
    v_cache.index_copy_(0, paged.slot_mapping, new_v)

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)

    num_decode = paged.num_decode
    if num_decode:
        block_size = paged.kv_cache.block_size
        blocks = paged.decode_blocks.view(num_decode, -1)
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
            o = F.scaled_dot_product_attention(
                q_decode[start:end],
                keys,
                values,
                attn_mask=paged.decode_mask[start:end],
                scale=scaling,
            )
            out[start:end] = o.reshape(end - start, num_heads, head_dim)

    for span in paged.prefills:
        end = span.start + span.num_new
        q_span = q[span.start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.slots is None:
            k_span = key[:, :, span.start : end]
            v_span = value[:, :, span.start : end]
            o = F.scaled_dot_product_attention(
                q_span, k_span, v_span, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k_span = k_cache.index_select(0, span.slots).transpose(0, 1).unsqueeze(0)
            v_span = v_cache.index_select(0, span.slots).transpose(0, 1).unsqueeze(0)
            mask = _lower_right_causal(span.num_new, span.context_len, query.device)
            o = F.scaled_dot_product_attention(
                q_span, k_span, v_span, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        out[span.start : end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _lower_right_causal(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[q, k]`` mask: query ``i`` sees keys ``0 .. num_keys - num_queries + i``."""
    rows = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
    return torch.arange(num_keys, device=device)[None, :] <= rows


AttentionInterface.register(ATTENTION_NAME, paged_attention)
