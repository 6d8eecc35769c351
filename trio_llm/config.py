"""Frozen configuration objects.

`trio_llm.cli` is the only place that reads argv; the environment is read here, in
`default_cache_dir`, and nowhere else. Everything downstream receives these dataclasses.
The engine configuration crosses into the engine-core child once, at start-up, pickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

#: The name under which the bundled SmolLM2 GGUF file is served when no --model is given.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: Environment variable that overrides the folder where converted models are cached.
CACHE_DIR_ENV = "TRIO_LLM_CACHE_DIR"

#: KV cache size used when neither --num-kv-blocks nor --kv-cache-memory is given (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3

DTYPES = ("auto", "float32", "bfloat16")


def default_cache_dir() -> Path:
    """The folder for converted model weights: $TRIO_LLM_CACHE_DIR, else ~/.cache/trio_llm."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "trio_llm"


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how.

    Attributes:
        model: a local Hugging Face folder, a ``.gguf`` file, or `DEFAULT_MODEL`.
        dtype: ``auto`` (float32 on CPU), ``float32`` or ``bfloat16``; weights and KV cache.
        max_model_len: context length in tokens (prompt + output); ``None`` takes the
            model's ``max_position_embeddings``.
        download_dir: cache folder for converted GGUF weights; ``None`` uses
            `default_cache_dir`.
        seed: seed for the engine's default random generator (requests without a seed).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    download_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: number of blocks; overrides ``kv_cache_memory``.
        kv_cache_memory: bytes for the KV cache of all layers (keys and values); the block
            count is ``kv_cache_memory // bytes_per_block``. Default `DEFAULT_KV_CACHE_MEMORY`.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either num_kv_blocks or kv_cache_memory, not both")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be at least 1 byte")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step.

    Attributes:
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: token budget of one step (decode tokens plus prefill chunks).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine-core child needs; sent to it once, pickled, at start-up.

    Attributes:
        num_threads: torch intra-op threads in the engine; ``None`` uses every CPU core.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None

    def cache_dir(self) -> Path:
        """The folder for converted model weights."""
        if self.model.download_dir:
            return Path(self.model.download_dir)
        return default_cache_dir()


@dataclass(frozen=True)
class ServerConfig:
    """The API server's own settings.

    Attributes:
        served_model_names: names accepted in the ``model`` field; the first is listed
            first by /v1/models. Empty means the ``--model`` string.
        port: TCP port; 0 picks a free one (the bound address is printed).
        shutdown_timeout: seconds the engine child gets to exit after being told to stop
            before it is sent SIGTERM, then SIGKILL.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout: float = 5.0

    def model_names(self) -> tuple[str, ...]:
        """The served model names, defaulting to the ``--model`` string."""
        return self.served_model_names or (self.engine.model.model,)
