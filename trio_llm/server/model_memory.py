"""How much memory a model's engines will take, and how much the machine has left (a
server of several models, `trio_llm.server.model_pool`: a model that cannot fit is refused with a
503 naming both, never started into an out-of-memory kill).

The estimate reads only file headers, never weights: a safetensors file's tensor shapes
(its JSON header), a GGUF file's tensor counts (de-quantized to the engine's dtype unless
``--quantization gguf`` keeps its blocks), other weight files by size. Each engine adds its
KV cache (``--kv-cache-memory``, or the default; none for an embedding model) and
`ENGINE_OVERHEAD` (the interpreter, torch, a step's activations). What the machine has
left is Linux's ``MemAvailable`` (`available_bytes`) plus what the server's own loaded
engines use now (`rss_bytes`: their estimate already accounts for it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from trio_llm.api.model_cards import POOLING_KINDS
from trio_llm.config import DEFAULT_KV_CACHE_MEMORY, PREFIX_CACHE_QUEUE_BYTES, EngineConfig
from trio_llm.model_files.dtype_choice import explain_quantization, resolve_dtype
from trio_llm.model_files.named_models import NAMED_MODELS
from trio_llm.model_files.weight_headers import read_gguf_header, safetensors_weights

#: Bytes an engine process takes besides its weights and KV cache: the interpreter with
#: torch and transformers loaded, the tokenizer, a step's activations (an idle CPU engine
#: of SmolLM2-135M in float32 holds about 0.9 GiB of which 0.55 are weights).
ENGINE_OVERHEAD = 512 * 2**20
#: Bytes left free for everything else on the machine.
MARGIN = 512 * 2**20
#: The smallest KV cache an engine is started with (bytes); less is "cannot fit".
MIN_KV_CACHE = 32 * 2**20
#: Bytes per weight in memory, by ``--dtype``.
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
#: Bytes per element of the safetensors dtypes (a quantized file is de-quantized).
_FILE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class MemoryNeed:
    """What one model's engines take (bytes, all ``--data-parallel-size`` copies).

    Attributes:
        weights: the weights in memory.
        kv_cache: the KV caches as configured.
        overhead: `ENGINE_OVERHEAD` per engine.
        engines: the number of engines.
    """

    weights: int
    kv_cache: int
    overhead: int
    engines: int = 1

    @property
    def total(self) -> int:
        """Weights, KV caches and overhead."""
        return self.weights + self.kv_cache + self.overhead


def estimate(config: EngineConfig, kind: str, engines: int = 1) -> MemoryNeed:
    """What ``engines`` engines of ``config``'s model will take (reads file headers).

    Args:
        kind: the catalog's kind of the model (`POOLING_KINDS` have no KV cache unless
            ``--runner generate``).

    Raises:
        OSError: a weight file cannot be read.
    """
    model = config.model
    pooling = model.runner == "pooling" or (model.runner == "auto" and kind in POOLING_KINDS)
    # An embedding model's auto is float32 (`trio_llm.engine.pooling`).
    dtype = "float32" if pooling and model.dtype == "auto" else model.dtype
    per_weight = _DTYPE_BYTES[resolve_dtype(dtype, model.device)]
    weights = weight_bytes(model.model, per_weight, _keeps_gguf_blocks(config))
    kv = 0 if pooling else (config.cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    if not pooling and config.prefix_cache_folder() is not None:
        kv += PREFIX_CACHE_QUEUE_BYTES  # the disk tier's queue of block copies
    return MemoryNeed(weights * engines, kv * engines, ENGINE_OVERHEAD * engines, engines)


def _keeps_gguf_blocks(config: EngineConfig) -> bool:
    """Whether the engine will keep the GGUF blocks (``--quantization gguf``, given or
    picked: `trio_llm.model_files.dtype_choice.explain_quantization`, here without loading the
    kernels, so a machine without them is estimated as if it had them)."""
    model = config.model
    if model.quantization is not None:
        return model.quantization == "gguf"
    named = NAMED_MODELS.get(model.model)
    gguf = Path(named.file_name if named is not None else model.model)
    if gguf.suffix != ".gguf":
        return False
    method, _ = explain_quantization(None, model.dtype, model.device, gguf, lambda path: None)
    return method == "gguf"


def weight_bytes(model: str, per_weight: int, keep_gguf_blocks: bool = False) -> int:
    """Bytes of ``model``'s weights in memory at ``per_weight`` bytes each (a GGUF
    file kept quantized, ``keep_gguf_blocks``, takes its own size).

    Raises:
        OSError: a weight file cannot be read.
    """
    named = NAMED_MODELS.get(model)
    if named is not None:
        chunks = named.chunk_paths(model)
        if len(chunks) == 1:
            return _gguf_bytes(chunks[0], per_weight, keep_gguf_blocks)
        # Not joined yet: as many bytes per weight as 4-bit blocks would give.
        size = sum(chunk.stat().st_size for chunk in chunks)
        return size if keep_gguf_blocks else size * 2 * per_weight
    path = Path(model).expanduser()
    if path.is_file():
        return _gguf_bytes(path, per_weight, keep_gguf_blocks)
    total = 0
    for file in sorted(path.iterdir()) if path.is_dir() else []:
        if file.suffix == ".safetensors":
            total += safetensors_weights(file) * per_weight
        elif file.suffix in _FILE_WEIGHT_SUFFIXES:
            total += file.stat().st_size * per_weight // 2  # 16-bit weights, most likely
    return total


def _gguf_bytes(path: Path, per_weight: int, keep_blocks: bool) -> int:
    """Bytes of a GGUF file's weights in memory: de-quantized, or its own size."""
    stat = path.stat()
    if keep_blocks:
        return stat.st_size
    return _gguf_weights(str(path.resolve()), stat.st_size, stat.st_mtime_ns) * per_weight


@functools.lru_cache(maxsize=64)
def _gguf_weights(path: str, size: int, mtime_ns: int) -> int:
    """The number of weights in a GGUF file, from its header (read once per file version,
    every declared size checked: `trio_llm.model_files.weight_headers.read_gguf_header`).

    Raises:
        OSError: not a GGUF file, or one whose header is cut short or declares more than
            the file holds (`trio_llm.model_files.weight_headers.WeightFileError`).
    """
    return read_gguf_header(path).num_weights


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Linux's ``MemAvailable`` (bytes), or None where there is none."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (bytes; 0 once it is gone)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    import resource

    return pages * resource.getpagesize()
