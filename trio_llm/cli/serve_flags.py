"""The flags of ``trio-llm serve``, one `Flag` per configuration field (flag names follow
vLLM's).

`SERVE_FLAGS` is a table: for each configuration dataclass, its fields that have a flag,
in ``--help`` order. A field's default and allowed ``choices`` are the dataclass's own
(`trio_llm.config_fields.setting`); the table adds what only the command line needs: the
flag's name where it is not ``--field-name``, aliases, help, metavar and the value's
parser. `trio_llm.cli.main` turns each entry into an argument and each parsed value back into
the field's value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trio_llm.cli import types as parse
from trio_llm.config import (
    CACHE_DIR_ENV,
    DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    DEFAULT_MODEL,
    GEMMA3_270M_MODEL,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)
from trio_llm.server_config import (
    API_KEY_ENV,
    ModelsConfig,
    RequestLimits,
    RestartPolicy,
    ServerConfig,
    StoreConfig,
    default_api_key,
)
from trio_llm.text.chat_template import read_chat_template

#: `Flag.default` meaning "the field's own default".
FIELD_DEFAULT: Any = object()


@dataclass(frozen=True)
class Flag:
    """How one configuration field is set from the command line.

    Attributes:
        help: the ``--help`` text (``%(default)s`` is the default).
        name: the flag; None: ``--`` and the field's name with dashes.
        aliases: more option strings (``-dp``).
        type: parses the flag's text (`trio_llm.cli.types`); None: ``int`` for an int
            field, the text itself otherwise. A bool field without one is a switch.
        metavar: the value's name in ``--help``.
        nargs: as argparse's (``"+"``: one or more values, a tuple field).
        default: the value when the flag is absent; `FIELD_DEFAULT`: the field's.
        convert: the parsed value -> the field's value; None: the parsed value.
        exclusive: the name of a group of flags of which at most one may be given.
        action: argparse's ``action`` (``"append"``: the flag may be given several times,
            its values gathered in a list).
    """

    help: str | None = None
    name: str | None = None
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    nargs: str | None = None
    default: Any = FIELD_DEFAULT
    convert: Callable[[Any], Any] | None = None
    exclusive: str | None = None
    action: str | None = None


def _env_api_key(value: str | None) -> str | None:
    """``--api-key``, else $TRIO_LLM_API_KEY."""
    return value if value is not None else default_api_key()


def _zero_is_none(value: float) -> float | None:
    """0 turns the limit off (None)."""
    return value or None


def _additional_properties(value: dict[str, bool]) -> bool:
    """``disable_additional_properties`` from ``--structured-outputs-config`` (default true)."""
    return value.get("disable_additional_properties", True)


def _auto_is_none(value: int | str | None) -> int | None:
    """``--num-threads auto`` fixes no count (`EngineConfig.adaptive_threads` is set)."""
    return value if isinstance(value, int) else None


def _none_is_none(value: str | None) -> str | None:
    """``--prefix-cache-dir none`` keeps the prefix cache in memory only."""
    return None if value is None or value.strip().lower() == "none" else value


_SECONDS = {"type": parse.parse_seconds, "metavar": "SECONDS"}
_COUNT = {"type": parse.parse_positive_int, "metavar": "N"}

SERVE_FLAGS: dict[type, dict[str, Flag]] = {
    ModelConfig: {
        "model": Flag(
            default=None,
            help=f"local HF folder, .gguf file, {DEFAULT_MODEL} (default) or "
            f"{GEMMA3_270M_MODEL} (make gemma3); give it several times to serve several "
            "models (the first is the default, loaded at start-up; the others load on "
            "their first request)",
            action="append",
        ),
        "dtype": Flag("auto = bfloat16 on CUDA or a CPU with native bf16, else float32"),
        "device": Flag("where the model runs"),
        "quantization": Flag(
            "weight-only quantization made at load time (CPU): int8 per output channel or "
            "int4 in groups of 32; fastest for few concurrent requests; gguf: a GGUF model's "
            "own quantized blocks with int8-activation kernels (Llama GGUF files) "
            "(default: none)",
            aliases=("-q",),
        ),
        "model_impl": Flag(
            "auto: the engine's own forward pass where the family has one (Llama), else "
            "transformers' modules; trio_llm: require it; transformers: never"
        ),
        "attention_backend": Flag(
            "auto: the engine's native CPU attention kernels where they build and load "
            "(CPU), else the pure-torch path; CPU_ATTN: require the kernels; TORCH_SDPA: the "
            "pure-torch reference path"
        ),
        "enforce_eager": Flag(
            "on a GPU, run every decode step eagerly instead of replaying CUDA graphs"
        ),
        "runner": Flag(
            "generate: a language model (completions, chat, messages, responses); pooling: "
            "an embedding model (/v1/embeddings; a decoder is pooled at its last token); "
            "auto: pooling for a sentence-transformers folder (modules.json), else generate"
        ),
        "max_model_len": Flag(),
        "seed": Flag(),
        "download_dir": Flag(
            f"converted-model cache (default ${CACHE_DIR_ENV} or ~/.cache/trio_llm)"
        ),
    },
    SchedulerConfig: {
        "max_num_seqs": Flag(),
        "max_num_batched_tokens": Flag(),
        "long_prefill_token_threshold": Flag(
            "a prompt with more tokens than this left to prefill computes at most this many "
            "per step, so running streams keep flowing (0: off; default "
            f"{DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD} on the CPU, off on CUDA)",
            type=parse.parse_non_negative_int,
            metavar="TOKENS",
        ),
        "max_num_partial_prefills": Flag(
            "most long prompts prefilled in one step (default %(default)s)", **_COUNT
        ),
        "scheduling_policy": Flag(
            "fcfs: requests in arrival order (a request's nonzero `priority` is refused); "
            "priority: by `priority`, lower first, then arrival, a better request "
            "preempting the worst running one when the batch or the KV cache is full "
            "(default %(default)s)"
        ),
        "max_batch_share": Flag(
            "batch-lane requests (the in-process batch runner's) hold at most this share "
            "of --max-num-seqs while interactive requests wait, and compute at most that "
            "many tokens a step while interactive requests are served (and 2 s after); "
            "with none around they may fill the batch. Larger: faster batches, slower "
            "interactive first tokens (default %(default)s: 4 of 128)",
            type=parse.parse_share,
            metavar="SHARE",
        ),
    },
    CacheConfig: {
        "block_size": Flag(),
        "num_kv_blocks": Flag(exclusive="kv"),
        "kv_cache_memory": Flag(type=parse.parse_bytes, metavar="BYTES", exclusive="kv"),
        "kv_cache_dtype": Flag(
            "the dtype of the cached keys and values; auto: the model's, except a float32 "
            "model with --quantization gguf on a CPU with AVX-512-BF16 keeps bfloat16 "
            "(twice the blocks in the same memory); a 16-bit cache rounds each key and "
            "value once, so outputs move slightly from the model's float32 ones "
            "(default %(default)s)"
        ),
        "enable_prefix_caching": Flag(
            "reuse the KV blocks of prompt prefixes computed before (default on)"
        ),
        "disable_hybrid_kv_cache_manager": Flag(
            "keep the whole context's keys and values in sliding-window layers too "
            "(by default they free the KV blocks behind their window)"
        ),
        "prefix_cache_dir": Flag(
            "a folder for the prefix cache's tier on disk: prompt blocks survive restarts "
            "and are shared by every engine and server of the same model (auto: "
            "$TRIO_LLM_PREFIX_CACHE_DIR, else prefix-cache in the cache folder; none: "
            "memory only; default %(default)s)",
            metavar="DIR|none",
            convert=_none_is_none,
        ),
        "prefix_cache_disk_bytes": Flag(
            "the bound on the disk tier's files of one model (default: a tenth of the free disk)",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
    },
    LoRAConfig: {
        "enable_lora": Flag(
            "serve LoRA adapters over the model (--lora-modules; POST /v1/load_lora_adapter): "
            "a request's model names one; a step mixes adapters and the base model"
        ),
        "max_loras": Flag(
            "most adapters in the running batch at once; a request of another waits for a "
            "place (default %(default)s)",
            **_COUNT,
        ),
        "max_lora_rank": Flag("largest adapter rank served (default %(default)s)", **_COUNT),
        "max_cpu_loras": Flag(
            "adapters kept loaded in the engine's memory, least recently used dropped first "
            "(default: --max-loras)",
            **_COUNT,
        ),
    },
    EngineConfig: {
        "num_threads": Flag(
            "torch threads in the engine. Default and auto: all cores, one fewer per "
            "core other processes take (beside a one-core hog on 2 cores 1.3-1.8x slower "
            "instead of 3-8x; float32 results then vary with the load at the 1e-6 level); "
            "N: exactly N, the same bits for the same requests (default with "
            "--data-parallel-size above 1: an equal share of the cores each)",
            type=parse.parse_num_threads,
            metavar="N|auto",
            convert=_auto_is_none,
        ),
    },
    ServerConfig: {
        "served_model_names": Flag(
            "name(s) clients use in `model`; with several --model flags, the i-th "
            "--served-model-name names the i-th --model (without one: the first --model's "
            "string, a later one's file or folder name)",
            name="--served-model-name",
            nargs="+",
            action="append",
        ),
        "host": Flag(),
        "port": Flag("0 picks a free port", type=parse.parse_port),
        "shutdown_timeout": Flag(
            "on SIGTERM, how long in-flight requests may finish before they are aborted; "
            "also how long the engine gets to exit (default %(default)s)",
            **_SECONDS,
        ),
        "data_parallel_size": Flag(
            "engine cores, each with its own model copy and KV cache (on CUDA one GPU "
            "each, on the CPU an equal share of the cores); requests go to the least-loaded "
            "one, preferring the one that holds the prompt's prefix (default %(default)s)",
            aliases=("-dp",),
            **_COUNT,
        ),
        "engine_restart": Flag(
            "never: an engine failure stops the server (exit 1); on-failure: fail the "
            "in-flight requests and start a new engine (default %(default)s)"
        ),
        "engine_step_timeout": Flag(
            "an engine silent (no heartbeat) or in one step for this long counts as hung "
            "and is killed; 0 turns hang detection off (default %(default)s)",
            convert=_zero_is_none,
            **_SECONDS,
        ),
        "api_key": Flag(
            f"require `Authorization: Bearer KEY` on /v1 routes (default ${API_KEY_ENV})",
            metavar="KEY",
            convert=_env_api_key,
        ),
        "chat_template": Flag(
            "a Jinja chat template file (or the template itself) to use instead of the "
            "model's own, e.g. for a model that has none",
            metavar="PATH",
            convert=read_chat_template,
        ),
        "trust_request_chat_template": Flag(
            "use the chat_template a request brings (/v1/chat/completions, /tokenize), "
            "sandboxed and within --max-request-chat-template-bytes and "
            "--request-chat-template-timeout; without this flag such a request gets a 400 "
            "(vLLM's flag)"
        ),
        "enable_auto_tool_choice": Flag(
            'serve tool_choice "auto" (the default when a request has tools): the model '
            "decides, and --tool-call-parser reads its calls out of the text"
        ),
        "tool_call_parser": Flag(
            "the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: "
            "Hermes, Qwen, and the SmolLM2 template trio_llm ships) or llama3_json"
        ),
        "reasoning_parser": Flag(
            "how the model marks its reasoning (<think>...</think>): deepseek_r1 (all "
            "output before </think> is reasoning) or qwen3 (reasoning only between <think> "
            "and </think>; none with chat_template_kwargs enable_thinking false). Responses "
            "then carry it as reasoning / reasoning_content (chat), reasoning items "
            "(Responses) and thinking blocks (Messages)"
        ),
        "disable_additional_properties": Flag(
            'output constraints, as vLLM\'s flag: {"disable_additional_properties": false} '
            "reads JSON Schemas as the standard does (an object schema without "
            "additionalProperties allows unlisted properties, except strict ones); the "
            "default (true) generates only listed properties, as vLLM's default backend does",
            name="--structured-outputs-config",
            type=parse.parse_structured_outputs_config,
            default={},
            metavar="JSON",
            convert=_additional_properties,
        ),
        "lora_modules": Flag(
            "LoRA adapters served from the start, as name=path or vLLM's JSON "
            '{"name": ..., "path": ...}; each is checked against the model at start-up',
            nargs="+",
            type=parse.parse_lora_module,
            metavar="NAME=PATH",
        ),
        "allow_runtime_lora_updating": Flag(
            "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING); loads read only --allowed-lora-dir"
        ),
        "allowed_lora_dir": Flag(
            "the folder runtime adapter loads may read (symbolic links are followed)",
            metavar="DIR",
        ),
        "allowed_origins": Flag(
            "CORS: origins allowed to call the API from a browser ('*' for any; default: "
            "CORS off); also the origins whose pages may open /v1/ws (default: same origin "
            "only)",
            nargs="+",
            metavar="ORIGIN",
        ),
        "allowed_methods": Flag("CORS: allowed methods (default '*')", nargs="+", metavar="METHOD"),
        "allowed_headers": Flag(
            "CORS: allowed request headers (default '*')", nargs="+", metavar="HEADER"
        ),
        "allow_credentials": Flag("CORS: allow credentials"),
        "max_request_body_bytes": Flag(
            "larger request bodies get HTTP 413 (e.g. 8MiB, the default)",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
        "max_num_waiting_requests": Flag(
            "refuse new requests while N are waiting for the engine (default: no limit)",
            **_COUNT,
        ),
        "stream_interval": Flag(
            "output tokens (1-64) a stream gathers before sending them, after the first "
            "token (vLLM's flag; larger: fewer events, less API-server work per token; "
            "default 1)",
            type=parse.parse_stream_interval,
            metavar="N",
        ),
        "vllm_metric_names": Flag(
            "/metrics also lists every series under vLLM's vllm: prefix (for routers and "
            "endpoint pickers that read vllm:num_requests_waiting, vllm:kv_cache_usage_perc)"
        ),
        "disable_access_log": Flag(
            "write no access log (by default one line per HTTP request and WebSocket "
            "connection at info: client, method, path and query, status, duration, "
            "request id; a stream's when it ends)",
            aliases=("--disable-uvicorn-access-log",),
        ),
        "max_tokens_policy": Flag(
            "a max_tokens past the room the prompt leaves in the context: clamp lowers it "
            "to that room (llama.cpp's and Ollama's behaviour; the output then ends with "
            "finish_reason length), strict refuses the request with a 400 as vLLM does "
            "(default %(default)s)"
        ),
        "generation_config": Flag(
            "sampling defaults for requests that leave fields unset: auto reads the model "
            "folder's generation_config.json, vllm ignores it, a FOLDER reads its own (its "
            "max_new_tokens then caps every request) (vLLM's flag; default %(default)s)",
            metavar="auto|vllm|FOLDER",
        ),
        "override_generation_config": Flag(
            "generation-config keys laid over --generation-config, e.g. "
            '\'{"temperature": 0.7, "max_new_tokens": 512}\' (max_new_tokens here caps '
            "every request's output) (vLLM's flag)",
            type=parse.parse_json_object,
            metavar="JSON",
        ),
        "max_logprobs": Flag(
            "largest logprobs / top_logprobs a request may ask for",
            type=parse.parse_non_negative_int,
            metavar="N",
        ),
        "request_body_timeout": Flag(
            "a request body that takes longer to arrive gets 408 and its connection is "
            "closed (default %(default)s)",
            **_SECONDS,
        ),
        "detokenizer_mode": Flag(
            "detokenize in the API server (inline) or in a third process (process)"
        ),
    },
    RestartPolicy: {
        "max_restarts": Flag(
            "with on-failure: most restarts within --engine-restart-window before the "
            "server gives up (default %(default)s)",
            name="--engine-restart-max",
            **_COUNT,
        ),
        "window": Flag(
            "window over which restarts are counted (default %(default)s)",
            name="--engine-restart-window",
            **_SECONDS,
        ),
        "wait": Flag(
            "how long a new request waits for a restarting engine before it gets 503 "
            "(default %(default)s)",
            name="--engine-restart-wait",
            **_SECONDS,
        ),
    },
    RequestLimits: {
        "max_choices": Flag(
            "most choices (prompts x n) in one request (default %(default)s)", **_COUNT
        ),
        "max_chat_messages": Flag(
            "most messages in one chat request (default %(default)s)", **_COUNT
        ),
        "max_stop_strings": Flag(
            "most stop strings in one request (default %(default)s)", **_COUNT
        ),
        "max_stop_string_length": Flag(
            "longest stop string, in characters (default %(default)s)",
            type=parse.parse_positive_int,
            metavar="CHARS",
        ),
        "max_request_chat_template_bytes": Flag(
            "with --trust-request-chat-template: longest chat_template a request may "
            "bring (default 64KiB)",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
        "request_chat_template_timeout": Flag(
            "with --trust-request-chat-template: longest a request's chat_template may "
            "take to render (default %(default)s)",
            **_SECONDS,
        ),
        "max_score_texts": Flag(
            "most texts on each side of a /score request and most documents of a /rerank "
            "(default %(default)s)",
            **_COUNT,
        ),
    },
    ModelsConfig: {
        "models_dir": Flag(
            "serve every model in this folder too: each .gguf file, Hugging Face folder "
            "and sentence-transformers folder, named after the file or folder (found at "
            "start-up and on POST /models/reload; loaded on its first request)",
            metavar="DIR",
        ),
        "max_loaded_models": Flag(
            "most models loaded at once: loading one more first unloads the least "
            "recently used idle one (0: no limit, the default)",
            type=parse.parse_non_negative_int,
            metavar="N",
            convert=_zero_is_none,
        ),
        "keep_alive": Flag(
            "how long an idle model stays loaded (Ollama's keep_alive: 5m, 30s, 1h; 0: "
            "unloaded when its last request ends; -1 or forever: until unloaded, the "
            "default); a request's keep_alive field changes it for its model",
            type=parse.parse_keep_alive,
            metavar="DURATION",
        ),
    },
    StoreConfig: {
        "url": Flag(
            "the database of stored responses, conversations, files and batches: "
            "sqlite:///PATH (relative to the working directory; sqlite:////PATH: absolute), or "
            "postgresql://USER@HOST/DB for replicas that share it "
            "(pip install 'trio_llm[postgres]'); none keeps nothing (default: "
            f"sqlite under ${CACHE_DIR_ENV}, else ~/.cache/trio_llm/store/store.db)",
            name="--store-url",
            metavar="URL",
        ),
        "retention": Flag(
            "finished stored objects older than this are removed (30d, 12h, 90m, 3600s; "
            "none: kept until --store-max-size needs the room; default 30d)",
            name="--store-retention",
            type=parse.parse_duration,
            metavar="AGE",
        ),
        "max_size": Flag(
            "most bytes the store holds; the oldest finished objects go first (e.g. "
            "10GiB, the default; none: no limit)",
            name="--store-max-size",
            type=parse.parse_size_or_none,
            metavar="BYTES",
        ),
        "max_file_bytes": Flag(
            "largest file POST /v1/files accepts (default 512MiB)",
            name="--max-file-size",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
        "upload_min_rate": Flag(
            "slowest average rate of an upload, in bytes per second: its body must be in "
            "within --request-body-timeout seconds plus one second per this many bytes "
            "received, else 408 (default 32KiB)",
            name="--upload-min-rate",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
        "batch_max_in_flight": Flag(
            "most lines of /v1/batches running at once, of all batches (default: "
            "--max-num-seqs per engine)",
            name="--batch-max-lines-in-flight",
            **_COUNT,
        ),
        "max_background_responses": Flag(
            "most background responses (background: true) queued or in progress at once; "
            "a new one past it gets a 429 with Retry-After; they run in the batch lane "
            "(default: --max-num-seqs per engine)",
            **_COUNT,
        ),
        "max_conversation_items": Flag(
            "most items one conversation stores (reasoning items too); an append past it "
            "is a 400 (default 10000)",
            **_COUNT,
        ),
        "max_conversation_bytes": Flag(
            "most bytes of one conversation's items (reasoning items too); an append past "
            "it is a 400 (default 16MiB)",
            name="--max-conversation-size",
            type=parse.parse_bytes,
            metavar="BYTES",
        ),
    },
}
