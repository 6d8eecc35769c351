"""Frozen configuration of the API server: its address, limits, engine supervision and
the request-level options (CORS, API key, tool and reasoning parsers).

`ServerConfig` holds the `trio_llm.config.EngineConfig` its engines run;
`default_api_key` is where ``$TRIO_LLM_API_KEY`` is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trio_llm.config import (
    DETOKENIZER_MODES,
    MAX_TOKENS_POLICIES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    EngineConfig,
)
from trio_llm.config_fields import CheckedFields, Range, setting

#: Environment variable holding the API key when --api-key is not given.
API_KEY_ENV = "TRIO_LLM_API_KEY"

#: Largest request body accepted by default (bytes).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024**2
#: Largest ``--stream-interval`` (tokens): a stream's unread tokens are held in memory, and
#: longer pieces stop looking like streaming.
MAX_STREAM_INTERVAL = 64

#: What the supervisor does when an engine child dies or hangs (``--engine-restart``).
RESTART_MODES = ("never", "on-failure")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_api_key() -> str | None:
    """The API key from $TRIO_LLM_API_KEY, or None when it is unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


@dataclass(frozen=True)
class RestartPolicy(CheckedFields):
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

    max_restarts: int = setting(5, range=Range(1))
    window: float = setting(60.0, range=Range(0))
    initial_backoff: float = setting(0.5, range=Range(0))
    max_backoff: float = setting(10.0, range=Range(0))
    wait: float = setting(30.0, range=Range(0))

    def backoff(self, num_recent_failures: int) -> float:
        """Seconds to wait before restarting after the n-th recent failure (n >= 1)."""
        exponent = min(max(num_recent_failures, 1) - 1, 30)
        return min(self.max_backoff, self.initial_backoff * 2**exponent)


@dataclass(frozen=True)
class RequestLimits(CheckedFields):
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
        max_request_chat_template_bytes: longest ``chat_template`` a request may bring
            (UTF-8 bytes; with ``trust_request_chat_template``).
        request_chat_template_timeout: seconds a request's ``chat_template`` may take
            to render (`trio_llm.text.template_guard`).
        max_score_texts: most texts on each side of a ``/score`` request and most
            documents of a ``/rerank`` (`trio_llm.api.scoring`).
    """

    max_choices: int = setting(1024, range=Range(1))
    max_chat_messages: int = setting(2048, range=Range(1))
    max_stop_strings: int = setting(64, range=Range(1))
    max_stop_string_length: int = setting(256, range=Range(1))
    max_request_chat_template_bytes: int = setting(64 * 1024, range=Range(1, unit="byte"))
    request_chat_template_timeout: float = setting(2.0, range=Range(0, exclusive=True))
    max_score_texts: int = setting(2048, range=Range(1))


#: ``--store-url`` value that turns the store off (no stored responses, files or batches).
NO_STORE = "none"


@dataclass(frozen=True)
class StoreConfig(CheckedFields):
    """Where and how long the server keeps state (`trio_llm.store`).

    Attributes:
        url: the database: ``sqlite:///PATH`` (relative; ``sqlite:////PATH`` absolute) or
            ``postgresql://...``; None: a SQLite file
            ``store/store.db`` under the cache folder; `NO_STORE`: keep nothing
            (``store: true`` and the stateful endpoints are then refused).
        retention: seconds a finished object is kept; None: until the size limit needs
            its room.
        max_size: most bytes of stored objects and file contents; None: no limit.
        max_file_bytes: largest file ``POST /v1/files`` accepts (bytes).
        upload_min_rate: slowest average rate an upload's body may arrive at (bytes per
            second): it must be in within ``request_body_timeout`` seconds plus one second
            per ``upload_min_rate`` bytes received (`trio_llm.api.batch.file_upload`).
        batch_max_in_flight: most batch lines (of all batches) running at once; None:
            ``--max-num-seqs`` per engine.
        max_background_responses: most background responses (``background: true``)
            queued or in progress on the server at once (past it: a 429); None:
            ``--max-num-seqs`` per engine (`ServerConfig.engine_slots`).
        max_conversation_items: most items one conversation stores (an append past it:
            a 400).
        max_conversation_bytes: most bytes of one conversation's items and metadata
            (an append past it: a 400).
    """

    url: str | None = None
    retention: float | None = setting(30 * 86400.0, range=Range(0, exclusive=True))
    max_size: int | None = setting(10 * 2**30, range=Range(1, unit="byte"))
    max_file_bytes: int = setting(512 * 2**20, range=Range(1, unit="byte"))
    upload_min_rate: int = setting(32 * 1024, range=Range(1, unit="byte"))
    batch_max_in_flight: int | None = setting(None, range=Range(1), none_means="--max-num-seqs")
    max_background_responses: int | None = setting(
        None, range=Range(1), none_means="--max-num-seqs"
    )
    max_conversation_items: int = setting(10_000, range=Range(1))
    max_conversation_bytes: int = setting(16 * 2**20, range=Range(1, unit="byte"))

    @property
    def enabled(self) -> bool:
        """Whether the server keeps a store at all."""
        return self.url != NO_STORE

    def resolved_url(self, cache_dir: Path) -> str:
        """The database URL, the default one under ``cache_dir`` when unset."""
        if self.url is None:
            return f"sqlite:///{cache_dir / 'store' / 'store.db'}"
        return self.url


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def keep_alive_seconds(value: object) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a duration (``"5m"``,
    ``"30s"``, ``"1h30m"``, ``"300"``); a negative one or ``"forever"`` -> None (never
    unloaded); 0: unloaded once its last request ends.

    Raises:
        ValueError: anything else (the message says what is accepted).
    """
    problem = (
        f"keep_alive must be a number of seconds or a duration like 5m, 30s or 1h30m "
        f"(negative or 'forever': never unloaded), not {value!r}"
    )
    if isinstance(value, bool):
        raise ValueError(problem)
    if isinstance(value, int) and value < 0:
        return None
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # a JSON integer past a double's range
            raise ValueError(problem) from None
    elif isinstance(value, str):
        text = value.strip().lower()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("-")
        if text == "forever":
            return None
        if re.fullmatch(r"\d+(?:\.\d+)?", body):
            seconds = sign * float(body)
        elif body and _DURATION_PART.sub("", body) == "":
            total = sum(
                float(number) * _DURATION_UNITS[unit]
                for number, unit in _DURATION_PART.findall(body)
            )
            seconds = sign * total
        else:
            raise ValueError(problem)
    else:
        raise ValueError(problem)
    if not math.isfinite(seconds):
        raise ValueError(problem)
    return None if seconds < 0 else seconds


@dataclass(frozen=True)
class ModelsConfig(CheckedFields):
    """The models of a server of several (``--model`` more than once, ``--models-dir``):
    which, how many loaded at once, and how long an idle one stays loaded.

    Attributes:
        flagged: every ``--model`` flag in order, each with its ``--served-model-name``
            names (empty: the model string); the first is the default model (the
            `ServerConfig`'s ``engine.model.model``). Empty: the one model of ``engine``
            (and, with ``models_dir``, the folder's models, the first of them the default).
        models_dir: a folder whose GGUF files, Hugging Face and sentence-transformers
            folders are served too (found at start-up and on ``POST /models/reload``).
        max_loaded_models: most models loaded at once; loading one more first unloads the
            least recently used idle one. None: no limit.
        keep_alive: seconds an idle model stays loaded (Ollama's ``keep_alive``; 0: it is
            unloaded when its last request ends); None: until unloaded (the default).
    """

    flagged: tuple[tuple[str, tuple[str, ...]], ...] = ()
    models_dir: str | None = None
    max_loaded_models: int | None = setting(None, range=Range(1), none_means="no limit")
    keep_alive: float | None = setting(None, range=Range(0), none_means="forever")

    @property
    def several(self) -> bool:
        """Whether the server may serve more than one model."""
        return len(self.flagged) > 1 or self.models_dir is not None


@dataclass(frozen=True)
class ServerConfig(CheckedFields):
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
        trust_request_chat_template: a request's own ``chat_template`` is used (within
            `RequestLimits`' caps); off (vLLM's default), it is a 400 naming the field.
        disable_access_log: no access log (`trio_llm.api.http.access_log`: a line per HTTP
            request and WebSocket connection at ``info``, on by default).
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
        store: the database of stored responses, conversations, files and batches.
        models: the models of a server of several (`ModelsConfig`); a server of one
            leaves it at its default.
        lora_modules: ``(name, folder)`` of the LoRA adapters served from the start.
        allow_runtime_lora_updating: serve vLLM's adapter load and unload routes; loads
            read only ``allowed_lora_dir`` (`trio_llm.frontend.lora_adapters`).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout: float = setting(5.0, range=Range(0))
    engine_restart: str = setting("never", choices=RESTART_MODES)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    engine_step_timeout: float | None = setting(
        60.0, range=Range(0, exclusive=True), none_means="no limit"
    )
    api_key: str | None = field(default=None, repr=False)
    chat_template: str | None = field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_request_body_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BODY_BYTES, range=Range(1, unit="byte")
    )
    max_num_waiting_requests: int | None = setting(None, range=Range(1), none_means="no limit")
    stream_interval: int = setting(1, range=Range(1, MAX_STREAM_INTERVAL))
    max_logprobs: int = setting(20, range=Range(0))
    limits: RequestLimits = field(default_factory=RequestLimits)
    request_body_timeout: float = setting(30.0, range=Range(0, exclusive=True))
    detokenizer_mode: str = setting("inline", choices=DETOKENIZER_MODES)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = setting(None, choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(None, choices=REASONING_PARSERS)
    disable_additional_properties: bool = True
    vllm_metric_names: bool = False
    disable_access_log: bool = False
    trust_request_chat_template: bool = False
    max_tokens_policy: str = setting("clamp", choices=MAX_TOKENS_POLICIES)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    data_parallel_size: int = setting(1, range=Range(1))
    store: StoreConfig = field(default_factory=StoreConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False
    allowed_lora_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            self.lora_modules or self.allow_runtime_lora_updating
        ) and not self.engine.lora.enable_lora:
            raise ValueError("--lora-modules and runtime adapter loads need --enable-lora")
        if self.allow_runtime_lora_updating and self.allowed_lora_dir is None:
            raise ValueError("--allow-runtime-lora-updating needs --allowed-lora-dir")
        cores = available_cores()
        if self.engine.model.device == "cpu" and self.data_parallel_size > cores:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} needs a CPU core per engine; "
                f"this machine has {cores}"
            )
        if self.api_key is not None:
            _check_api_key(self.api_key)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            _check_strings(name, getattr(self, name), empty_ok=name == "allowed_origins")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of "
                f"{', '.join(TOOL_CALL_PARSERS)})"
            )
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a JSON object (a dict)")

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

    def engine_slots(self) -> int:
        """Requests the server's engines run at once: ``--max-num-seqs`` per engine
        (the default of the limits of batch lines and background responses)."""
        return self.engine.scheduler.max_num_seqs * self.data_parallel_size

    def model_names(self) -> tuple[str, ...]:
        """The served model names, defaulting to the ``--model`` string."""
        return self.served_model_names or (self.engine.model.model,)

    def for_model(
        self, model: str, names: tuple[str, ...], kv_cache_memory: int | None = None
    ) -> ServerConfig:
        """This config for another model of the server: ``engine.model.model`` and the
        served names replaced, and with ``kv_cache_memory`` (bytes) that KV cache size
        (unless ``--num-kv-blocks`` fixes the cache)."""
        engine = replace(self.engine, model=replace(self.engine.model, model=model))
        if kv_cache_memory is not None and engine.cache.num_kv_blocks is None:
            engine = replace(engine, cache=replace(engine.cache, kv_cache_memory=kv_cache_memory))
        other = model != self.engine.model.model  # adapters belong to the default model
        lora = {"lora_modules": (), "allow_runtime_lora_updating": False} if other else {}
        return replace(self, engine=engine, served_model_names=names, **lora)


def _check_api_key(api_key: str) -> None:
    """Raise ValueError unless ``api_key`` can travel in an HTTP header: visible ASCII,
    no spaces, not empty."""
    if not api_key:
        raise ValueError("api_key must not be empty (leave it unset to turn keys off)")
    if not all(33 <= ord(char) <= 126 for char in api_key):
        raise ValueError(
            "api_key may only hold visible ASCII characters (no spaces or control characters)"
        )


def _check_strings(name: str, values: tuple[str, ...], *, empty_ok: bool) -> None:
    """Raise ValueError unless ``values`` (the field ``name``) is a tuple of non-empty
    strings, and not empty unless ``empty_ok``."""
    if isinstance(values, str):
        raise ValueError(f"{name} must be a tuple of strings, not one string")
    if any(not isinstance(v, str) or not v.strip() for v in values):
        raise ValueError(f"{name} must hold non-empty strings, got {values!r}")
    if not empty_ok and not values:
        raise ValueError(f"{name} must not be empty (use '*' to allow any)")
