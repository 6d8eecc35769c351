"""The disk tier beside one engine's block manager: what the engine loop calls
(`trio_llm.engine.loop`), so that `EngineCore.step` stays free of I/O.

- `PrefixTier.load`, before a request is added: the keys of its prompt's full blocks
  (`prefix_keys`, the salt included), the first that the block manager does not hold, and
  from there the blocks found on disk, read in a worker thread and written into free
  blocks of the KV cache, registered under their keys (`BlockManager.import_block`). The
  scheduler's lookup then finds them as it finds any cached block.
- `PrefixTier.after_step`: the blocks the step registered, copied out of the KV cache and
  offered to the writer (`DiskTier.offer`).

Every KV cache group is served (vLLM's hybrid manager: Gemma 3's sliding-window layers
share a block table apart from its full-attention ones): a full-attention group reads its
chain from the start, a sliding-window group only the blocks inside its window.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
import trio

from trio_llm.engine import kv_files
from trio_llm.engine.block_manager import prefix_keys
from trio_llm.engine.disk_tier import DiskTier, TierCounters
from trio_llm.messages import AddRequest, StepStats

if TYPE_CHECKING:
    from trio_llm.config import EngineConfig
    from trio_llm.engine.core import EngineCore

logger = logging.getLogger(__name__)

#: The share of the free disk the tier takes when ``--prefix-cache-disk-bytes`` is not given.
DEFAULT_DISK_SHARE = 0.1


class PrefixTier:
    """One engine's disk tier (see the module doc).

    Args:
        core: the engine core whose KV cache and block manager it serves.
        disk: the block files.
    """

    def __init__(self, core: EngineCore, disk: DiskTier) -> None:
        self.core = core
        self.disk = disk
        self.block_size = core.kv_cache.block_size
        core.block_manager.registered = []

    @classmethod
    def open(cls, core: EngineCore, config: EngineConfig) -> PrefixTier | None:
        """The tier ``config`` asks for (``--prefix-cache-dir``), or None: none asked,
        prefix caching off, or a model of several KV cache groups (said in the log)."""
        root_path = config.prefix_cache_folder()
        if root_path is None:
            return None
        root_path.mkdir(parents=True, exist_ok=True)
        bound = config.cache.prefix_cache_disk_bytes
        if bound is None:
            bound = int(shutil.disk_usage(root_path).free * DEFAULT_DISK_SHARE)
        space = kv_files.namespace(namespace_fields(core, config))
        disk = DiskTier(root_path, space, bound, core.kv_cache_dtype, block_shapes(core))
        logger.info(
            "prefix cache on disk: %s (namespace %s, at most %.1f GiB)",
            disk.folder,
            space[:12],
            bound / 2**30,
        )
        return cls(core, disk)

    @property
    def counters(self) -> TierCounters:
        """The disk tier's running totals."""
        return self.disk.counters

    def with_counters(self, stats: StepStats) -> StepStats:
        """``stats`` with the tier's running totals (its ``disk_*`` fields)."""
        fields = {f"disk_{name}": value for name, value in vars(self.counters).items()}
        return msgspec.structs.replace(stats, **fields)

    async def load(self, message: AddRequest) -> int:
        """Bring the blocks of ``message``'s prompt found on disk, and not in memory, into
        the KV cache; returns how many came (of every KV cache group)."""
        manager = self.core.block_manager
        keys = prefix_keys(message.prompt_token_ids, self.block_size, message.params)
        wanted = await trio.to_thread.run_sync(self._read_prefix, keys, manager.num_free_blocks)
        imported = 0
        for group, key, tensors in wanted:
            block = manager.import_block(group, key)
            if block is None:
                break
            self._write_block(group, block, tensors)
            imported += 1
        return imported

    def _read_prefix(
        self, keys: list[bytes], room: int
    ) -> list[tuple[int, bytes, list[torch.Tensor]]]:
        """The blocks of ``keys`` on disk that memory lacks, at most ``room`` of them: in
        each full-attention group the chain up to the first block found nowhere (the hit
        ends there), then in each sliding-window group the blocks inside the window
        before the hit's end (`BlockManager.first_needed_block`: older ones are never
        read by the request)."""
        manager = self.core.block_manager
        full = [g for g, window in enumerate(manager.windows) if window is None]
        end = len(keys)
        chain: list[tuple[int, int, bytes, list[torch.Tensor]]] = []
        for index, key in enumerate(keys):
            if len(chain) + len(full) > room:
                end = index  # no room for this block in every group
                break
            for group in full:
                if manager.cached_block(group, key) is not None:
                    continue
                tensors = self.disk.read(group, key)
                if tensors is None:
                    end = index  # this group has no block here: the hit ends before it
                    break
                chain.append((index, group, key, tensors))
            if end == index:
                break
        found = [(group, key, tensors) for index, group, key, tensors in chain if index < end]
        for group, window in enumerate(manager.windows):
            if window is None:
                continue
            first = manager.first_needed_block(group, end * self.block_size)
            for key in keys[first:end]:
                if len(found) >= room:
                    break
                if manager.cached_block(group, key) is None:
                    tensors = self.disk.read(group, key)
                    if tensors is not None:
                        found.append((group, key, tensors))
        return found[:room]

    def _write_block(self, group: int, block: int, tensors: list[torch.Tensor]) -> None:
        """Copy one block's keys and values (layer by layer of ``group``, keys first) into
        the cache."""
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        cache = self.core.kv_cache
        for i, layer in enumerate(self.core.kv_groups.layers[group]):
            cache.keys[layer][rows].copy_(tensors[2 * i])
            cache.values[layer][rows].copy_(tensors[2 * i + 1])

    def after_step(self) -> None:
        """Offer the blocks the last step registered to the writer, copied out of the
        cache now (their blocks may be reused by the next step)."""
        cache = self.core.kv_cache
        for group, key, block in self.core.block_manager.take_registered():
            rows = slice(block * self.block_size, (block + 1) * self.block_size)
            tensors = []
            for layer in self.core.kv_groups.layers[group]:
                tensors.append(cache.keys[layer][rows].to("cpu", copy=True))
                tensors.append(cache.values[layer][rows].to("cpu", copy=True))
            self.disk.offer(group, key, tensors)

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self.disk.close()


def block_shapes(core: EngineCore) -> list[tuple[int, ...]]:
    """The shape of each tensor of a block (keys then values, layer by layer)."""
    shapes = []
    for layer in core.kv_groups.layers[0]:
        spec = core.layers[layer]
        shape = (core.kv_cache.block_size, spec.num_kv_heads, spec.head_dim)
        shapes += [shape, shape]
    return shapes


def namespace_fields(core: EngineCore, config: EngineConfig) -> dict[str, object]:
    """What makes two engines' blocks the same: the model's content, its dtype and
    quantization, the KV dtype, the block size and the layout of a block."""
    return {
        "model": model_digest(Path(core.info.model_dir), config.prefix_cache_folder() or Path()),
        "dtype": core.info.dtype,
        "quantization": config.model.weight_quantization,
        "model_impl": config.model.model_impl,
        "kv_dtype": str(core.kv_cache_dtype),
        "block_size": core.kv_cache.block_size,
        "shapes": [list(shape) for shape in block_shapes(core)],
    }


def model_digest(folder: Path, cache_root: Path) -> str:
    """A sha256 over the model folder's files (names and contents), kept under
    ``cache_root`` by each file's size and modification time so that a restart does not
    read the weights again."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    stamp = json.dumps(
        [[str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    )
    stamp = json.dumps([str(folder.resolve()), stamp])
    cache = cache_root / "digests" / hashlib.sha256(stamp.encode()).hexdigest()
    try:
        return cache.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as file:
            while chunk := file.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary = cache.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(value)
        os.replace(temporary, cache)
    except OSError:
        pass  # a read-only folder: computed again at each start
    return value
