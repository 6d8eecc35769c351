"""The disk tier beside one engine's block manager: what the engine loop calls
(`trio_llm.engine.loop`), so that `EngineCore.step` stays free of I/O.

- `PrefixTier.load`, before a request is added: the keys of its prompt's full blocks
  (`prefix_keys`, the salt included), the first that the block manager does not hold, and
  from there the blocks found on disk, read in a worker thread and written into free
  blocks of the KV cache, registered under their keys (`BlockManager.import_block`). The
  scheduler's lookup then finds them as it finds any cached block.
- `PrefixTier.after_step`: the blocks the step registered, copied out of the KV cache and
  offered to the writer (`DiskTier.offer`).

The tier serves models with one KV cache group of full attention (sliding-window groups
keep only part of a prefix); other models keep their prefix cache in memory only.
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
        self._layers = core.kv_groups.layers[0]
        core.block_manager.registered = []

    @classmethod
    def open(cls, core: EngineCore, config: EngineConfig) -> PrefixTier | None:
        """The tier ``config`` asks for (``--prefix-cache-dir``), or None: none asked,
        prefix caching off, or a model of several KV cache groups (said in the log)."""
        root_path = config.prefix_cache_folder()
        if root_path is None:
            return None
        if len(core.kv_groups.layers) != 1 or core.kv_groups.windows[0] is not None:
            logger.info("prefix cache on disk: off (a model with sliding-window layers)")
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
        the KV cache; returns how many came."""
        manager = self.core.block_manager
        keys = prefix_keys(message.prompt_token_ids, self.block_size, message.params.cache_salt)
        start = 0
        while start < len(keys) and manager.cached_block(0, keys[start]) is not None:
            start += 1
        wanted = keys[start : start + manager.num_free_blocks]
        if not wanted:
            return 0
        found = await trio.to_thread.run_sync(self._read_chain, wanted)
        for key, tensors in zip(wanted, found, strict=False):
            block = manager.import_block(0, key)
            if block is None:
                break
            self._write_block(block, tensors)
        return len(found)

    def _read_chain(self, keys: list[bytes]) -> list[list[torch.Tensor]]:
        """The blocks of ``keys`` on disk, in order, up to the first one that is not."""
        found = []
        for key in keys:
            tensors = self.disk.read(0, key)
            if tensors is None:
                break
            found.append(tensors)
        return found

    def _write_block(self, block: int, tensors: list[torch.Tensor]) -> None:
        """Copy one block's keys and values (layer by layer, keys first) into the cache."""
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        cache = self.core.kv_cache
        for i, layer in enumerate(self._layers):
            cache.keys[layer][rows].copy_(tensors[2 * i])
            cache.values[layer][rows].copy_(tensors[2 * i + 1])

    def after_step(self) -> None:
        """Offer the blocks the last step registered to the writer, copied out of the
        cache now (their blocks may be reused by the next step)."""
        cache = self.core.kv_cache
        for group, key, block in self.core.block_manager.take_registered():
            rows = slice(block * self.block_size, (block + 1) * self.block_size)
            tensors = []
            for layer in self._layers:
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
