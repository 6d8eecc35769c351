"""The paged KV cache: each layer's key/value shape, how layers share blocks, the
tensors, and how many blocks a model and configuration get.

`LayerSpec` (one per layer, from `trio_llm.engine.attention_probe.probe_layers`) says what
a layer keeps; `KVGroups` splits the layers into groups that share block tables (vLLM's
hybrid KV cache manager); `kv_cache_dtype` picks the dtype of the keys and values
(``--kv-cache-dtype``); `KVCache` holds the tensors; `size_kv_cache` counts the blocks
that fit in ``--kv-cache-memory`` (or takes ``--num-kv-blocks``) and refuses a cache that
cannot hold one request of ``max_model_len`` tokens.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trio_llm.config import DEFAULT_KV_CACHE_MEMORY, CacheConfig
from trio_llm.engine.block_manager import cdiv
from trio_llm.errors import EngineConfigError
from trio_llm.model_files.dtype_choice import explain_kv_cache_dtype


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
    Memory: `bytes_per_block` ``* (num_blocks + 1)`` bytes, allocated once on ``device``
    (on the CPU mapped, not written: `zeroed`; a page is resident once a block on it is).
    The tensors' dtype (``--kv-cache-dtype``) may differ from the model's: writers cast
    new keys to it and readers cast what they read back to the query's dtype.
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
            dtype: of the keys and values (``--kv-cache-dtype``: the model's, or a
                16-bit one for a float32 model; `trio_llm.engine.attention` casts on
                write and read).
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
        keys = [zeroed(shape, dtype, device) for shape in shapes]
        values = [zeroed(shape, dtype, device) for shape in shapes]
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
        """Bytes one block takes: keys and values of one group's layers, each element
        ``dtype``'s item size (2 for bfloat16 and float16, 4 for float32)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        slots = [layers[i] for i in groups.layers[0]]
        per_token = sum(spec.num_kv_heads * spec.head_dim for spec in slots)
        return 2 * block_size * per_token * itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On the CPU it lies in an anonymous memory map, which the kernel
    fills with zeros page by page on first touch: a pool of gigabytes costs nothing until
    its blocks are written (``torch.zeros`` writes every page up front: about 2 s for the
    default model's 2 GiB pool on 2 cores, at every engine start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the map alive; the map is unmapped when the last view goes.
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=count).view(shape)


def context_slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache slots (int64 ``[length]``) of positions ``0 .. length - 1`` of a request
    whose block table is ``table`` (int64 ``[columns]``, non-negative, covering them)."""
    positions = torch.arange(length, device=table.device)
    return table[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class KVCacheSize:
    """How the KV cache is laid out and sized for one model and configuration.

    Attributes:
        groups: how the layers share the cache (`KVGroups.plan`).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        min_num_blocks: the fewest blocks this model and configuration accept: one
            request of ``max_model_len`` tokens (`blocks_for_one_request`).
    """

    groups: KVGroups
    num_blocks: int
    block_size: int
    min_num_blocks: int


def kv_cache_dtype(
    cache: CacheConfig, model_dtype: torch.dtype, quantization: str | None
) -> tuple[torch.dtype, str]:
    """The dtype of the cached keys and values for ``cache.kv_cache_dtype`` and a model of
    ``model_dtype`` run with ``quantization``, and why (for the start-up log); see
    `trio_llm.model_files.dtype_choice.explain_kv_cache_dtype` (``auto``: the model's dtype,
    bfloat16 for a float32 model on the GGUF path on a CPU with AVX-512-BF16)."""
    name, why = explain_kv_cache_dtype(
        cache.kv_cache_dtype, str(model_dtype).removeprefix("torch."), quantization
    )
    return getattr(torch, name), why


def size_kv_cache(
    layers: Sequence[LayerSpec],
    cache: CacheConfig,
    max_model_len: int,
    max_step_tokens: int,
    dtype: torch.dtype,
) -> KVCacheSize:
    """Group the layers and count the blocks: ``cache.num_kv_blocks``, or as many as fit
    in ``cache.kv_cache_memory`` bytes (default `DEFAULT_KV_CACHE_MEMORY`).

    Args:
        layers: one spec per layer (`probe_layers`).
        cache: the cache configuration (block size, size, hybrid grouping).
        max_model_len: tokens of the longest request.
        max_step_tokens: tokens one step may schedule (``max_num_batched_tokens``).
        dtype: of the keys and values (``--kv-cache-dtype``): its item size sets the
            bytes a block takes, so a 16-bit cache holds twice the blocks of a float32 one
            in the same ``kv_cache_memory``.

    Raises:
        EngineConfigError: the blocks cannot hold one request of ``max_model_len`` tokens.
    """
    block_size = cache.block_size
    groups = KVGroups.plan(layers, max_model_len, hybrid=not cache.disable_hybrid_kv_cache_manager)
    num_blocks = cache.num_kv_blocks
    if num_blocks is None:
        memory = cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = memory // KVCache.bytes_per_block(layers, groups, block_size, dtype)
    needed = blocks_for_one_request(groups, max_model_len, block_size, max_step_tokens)
    if num_blocks < needed:
        raise EngineConfigError(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one "
            f"request of max_model_len={max_model_len} tokens ({needed} blocks); give "
            "more --kv-cache-memory / --num-kv-blocks or a smaller --max-model-len"
        )
    return KVCacheSize(groups, num_blocks, block_size, needed)


def blocks_for_one_request(
    groups: KVGroups, max_model_len: int, block_size: int, max_step_tokens: int
) -> int:
    """Blocks one request of ``max_model_len`` tokens may hold at once: every block of a
    full-attention group; in a sliding-window group, those of its window and of one step's
    new tokens."""
    full = cdiv(max_model_len, block_size)
    total = 0
    for window in groups.windows:
        if window is None:
            total += full
        else:
            total += min(full, cdiv(window - 1 + max_step_tokens, block_size) + 1)
    return total


def describe_groups(groups: KVGroups, num_blocks: int, block_size: int) -> str:
    """E.g. ``"KV cache: 6 groups of 3 layers (5 freeing blocks behind a window), 21845
    blocks of 16 tokens"``."""
    windowed = sum(1 for window in groups.windows if window is not None)
    count = len(groups.windows)
    text = f"KV cache: {count} group{'s' if count > 1 else ''} of {groups.group_size} layers"
    if windowed:
        text += f" ({windowed} freeing blocks behind a window)"
    return f"{text}, {num_blocks} blocks of {block_size} tokens"


def describe_layers(layers: list[LayerSpec]) -> str:
    """E.g. ``"18 attention layers (15 with a 512-token window), 1 KV heads of 256"``."""
    windows = sorted({spec.sliding_window for spec in layers if spec.sliding_window})
    windowed = sum(1 for spec in layers if spec.sliding_window)
    parts = [f"{len(layers)} attention layers"]
    if windowed:
        sizes = "/".join(str(w) for w in windows)
        parts[0] += f" ({windowed} with a {sizes}-token window)"
    if any(spec.softcap for spec in layers):
        parts.append("softcapped attention")
    shapes = sorted({(spec.num_kv_heads, spec.head_dim) for spec in layers})
    parts.append(", ".join(f"{h} KV heads of {d}" for h, d in shapes))
    return ", ".join(parts)
