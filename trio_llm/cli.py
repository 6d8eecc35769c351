"""Command line: ``trio-llm serve [options]`` (flag names follow vLLM's)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from trio_llm.config import (
    API_KEY_ENV,
    ATTENTION_BACKENDS,
    CACHE_DIR_ENV,
    DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MODEL,
    DETOKENIZER_MODES,
    DEVICES,
    DTYPES,
    GEMMA3_270M_MODEL,
    MAX_STREAM_INTERVAL,
    MAX_TOKENS_POLICIES,
    MODEL_IMPLS,
    QUANTIZATION_METHODS,
    REASONING_PARSERS,
    RESTART_MODES,
    RUNNERS,
    TOOL_CALL_PARSERS,
    CacheConfig,
    RequestLimits,
    RestartPolicy,
    SchedulerConfig,
    ServerConfig,
    default_api_key,
    engine_config,
)
from trio_llm.errors import first_leaf
from trio_llm.logging_setup import (
    LOG_LEVEL_ENV,
    LOG_LEVELS,
    configure_logging,
    resolve_log_level,
)
from trio_llm.text.chat_template import read_chat_template

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4294967296"``, ``"4GiB"``, ``"512M"`` -> bytes (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def _bounded_int(text: str, low: int, high: int | None, what: str) -> int:
    """``int(text)`` if it lies in ``[low, high]``, else an argparse error naming ``what``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return value


def parse_port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0 picks a free one)."""
    return _bounded_int(text, 0, 65535, "a TCP port (0-65535)")


def parse_positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _bounded_int(text, 1, None, "a positive integer")


def parse_stream_interval(text: str) -> int:
    """A stream interval: an integer from 1 to `MAX_STREAM_INTERVAL` (tokens)."""
    return _bounded_int(text, 1, MAX_STREAM_INTERVAL, f"an integer from 1 to {MAX_STREAM_INTERVAL}")


def parse_num_threads(text: str) -> int | str:
    """A positive thread count, or ``auto``."""
    if text == "auto":
        return text
    return _bounded_int(text, 1, None, "a positive integer or auto")


def parse_non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _bounded_int(text, 0, None, "a non-negative integer")


def parse_seconds(text: str) -> float:
    """A non-negative, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


#: The keys of ``--structured-outputs-config`` this server takes (vLLM's names).
STRUCTURED_OUTPUTS_KEYS = ("disable_additional_properties",)


def parse_structured_outputs_config(text: str) -> dict[str, bool]:
    """vLLM's ``--structured-outputs-config``: a JSON object of `STRUCTURED_OUTPUTS_KEYS`
    (true or false each).

    Raises:
        argparse.ArgumentTypeError: not such an object (says which key or value).
    """
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    for key, setting in value.items():
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise argparse.ArgumentTypeError(
                f"{key!r} is not supported here; supported: {list(STRUCTURED_OUTPUTS_KEYS)}"
            )
        if not isinstance(setting, bool):
            raise argparse.ArgumentTypeError(f"{key} must be true or false, got {setting!r}")
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object (``--override-generation-config``), its values checked."""
    from trio_llm.frontend.generation_defaults import check_overrides

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    try:
        check_overrides(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="trio-llm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_tag", nargs="?", help="same as --model")
    serve.add_argument(
        "--model",
        default=None,
        help=f"local HF folder, .gguf file, {DEFAULT_MODEL} (default) or {GEMMA3_270M_MODEL} "
        "(make gemma3)",
    )
    serve.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use in `model`"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=parse_port, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto = bfloat16 on CUDA or a CPU with native bf16, else float32",
    )
    serve.add_argument("--device", choices=DEVICES, default="cpu", help="where the model runs")
    serve.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="weight-only quantization made at load time (CPU): int8 per output channel or "
        "int4 in groups of 32; fastest for few concurrent requests; gguf: a GGUF model's own "
        "quantized blocks with int8-activation kernels (Llama GGUF files) (default: none)",
    )
    serve.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="auto: the engine's own forward pass where the family has one (Llama), else "
        "transformers' modules; trio_llm: require it; transformers: never",
    )
    serve.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto: the engine's native CPU attention kernels where they build and load "
        "(CPU), else the pure-torch path; CPU_ATTN: require the kernels; TORCH_SDPA: the "
        "pure-torch reference path",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run every decode step eagerly instead of replaying CUDA graphs",
    )
    serve.add_argument(
        "--runner",
        choices=RUNNERS,
        default="auto",
        help="generate: a language model (completions, chat, messages, responses); pooling: "
        "an embedding model (/v1/embeddings; a decoder is pooled at its last token); auto: "
        "pooling for a sentence-transformers folder (modules.json), else generate",
    )
    serve.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    serve.add_argument(
        "--long-prefill-token-threshold",
        type=parse_non_negative_int,
        default=None,
        metavar="TOKENS",
        help="a prompt with more tokens than this left to prefill computes at most this many "
        "per step, so running streams keep flowing (0: off; default "
        f"{DEFAULT_CPU_LONG_PREFILL_TOKEN_THRESHOLD} on the CPU, off on CUDA)",
    )
    serve.add_argument(
        "--max-num-partial-prefills",
        type=parse_positive_int,
        default=SchedulerConfig.max_num_partial_prefills,
        metavar="N",
        help="most long prompts prefilled in one step (default %(default)s)",
    )
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    kv = serve.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None)
    kv.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES")
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="reuse the KV blocks of prompt prefixes computed before (default on)",
    )
    serve.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="keep the whole context's keys and values in sliding-window layers too "
        "(by default they free the KV blocks behind their window)",
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--download-dir",
        default=None,
        help=f"converted-model cache (default ${CACHE_DIR_ENV} or ~/.cache/trio_llm)",
    )
    serve.add_argument(
        "--num-threads",
        type=parse_num_threads,
        default=None,
        metavar="N|auto",
        help="torch threads in the engine. Default and auto: all cores, one fewer per "
        "core other processes take (beside a one-core hog on 2 cores 1.3-1.8x slower "
        "instead of 3-8x; float32 results then vary with the load at the 1e-6 level); "
        "N: exactly N, the same bits for the same requests (default with "
        "--data-parallel-size above 1: an equal share of the cores each)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=parse_seconds,
        default=ServerConfig.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may finish before they are aborted; "
        "also how long the engine gets to exit (default %(default)s)",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=parse_positive_int,
        default=ServerConfig.data_parallel_size,
        metavar="N",
        help="engine cores, each with its own model copy and KV cache (on CUDA one GPU "
        "each, on the CPU an equal share of the cores); requests go to the least-loaded "
        "one, preferring the one that holds the prompt's prefix (default %(default)s)",
    )
    serve.add_argument(
        "--engine-restart",
        choices=RESTART_MODES,
        default=ServerConfig.engine_restart,
        help="never: an engine failure stops the server (exit 1); on-failure: fail the "
        "in-flight requests and start a new engine (default %(default)s)",
    )
    serve.add_argument(
        "--engine-restart-max",
        type=parse_positive_int,
        default=RestartPolicy.max_restarts,
        metavar="N",
        help="with on-failure: most restarts within --engine-restart-window before the "
        "server gives up (default %(default)s)",
    )
    serve.add_argument(
        "--engine-restart-window",
        type=parse_seconds,
        default=RestartPolicy.window,
        metavar="SECONDS",
        help="window over which restarts are counted (default %(default)s)",
    )
    serve.add_argument(
        "--engine-restart-wait",
        type=parse_seconds,
        default=RestartPolicy.wait,
        metavar="SECONDS",
        help="how long a new request waits for a restarting engine before it gets 503 "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--engine-step-timeout",
        type=parse_seconds,
        default=ServerConfig.engine_step_timeout,
        metavar="SECONDS",
        help="an engine silent (no heartbeat) or in one step for this long counts as hung "
        "and is killed; 0 turns hang detection off (default %(default)s)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1 routes (default ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template file (or the template itself) to use instead of the "
        "model's own, e.g. for a model that has none",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request has tools): the model '
        "decides, and --tool-call-parser reads its calls out of the text",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen, and the SmolLM2 template trio_llm ships) or llama3_json",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="how the model marks its reasoning (<think>...</think>): deepseek_r1 (all "
        "output before </think> is reasoning) or qwen3 (reasoning only between <think> and "
        "</think>; none with chat_template_kwargs enable_thinking false). Responses then "
        "carry it as reasoning / reasoning_content (chat), reasoning items (Responses) and "
        "thinking blocks (Messages)",
    )
    serve.add_argument(
        "--structured-outputs-config",
        type=parse_structured_outputs_config,
        default={},
        metavar="JSON",
        help='output constraints, as vLLM\'s flag: {"disable_additional_properties": false} '
        "reads JSON Schemas as the standard does (an object schema without "
        "additionalProperties allows unlisted properties, except strict ones); the default "
        "(true) generates only listed properties, as vLLM's default backend does",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="CORS: origins allowed to call the API from a browser ('*' for any; default: "
        "CORS off); also the origins whose pages may open /v1/ws (default: same origin only)",
    )
    serve.add_argument(
        "--allowed-methods",
        nargs="+",
        default=list(ServerConfig.allowed_methods),
        metavar="METHOD",
        help="CORS: allowed methods (default '*')",
    )
    serve.add_argument(
        "--allowed-headers",
        nargs="+",
        default=list(ServerConfig.allowed_headers),
        metavar="HEADER",
        help="CORS: allowed request headers (default '*')",
    )
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="BYTES",
        help="larger request bodies get HTTP 413 (e.g. 8MiB, the default)",
    )
    serve.add_argument(
        "--max-num-waiting-requests",
        type=parse_positive_int,
        default=None,
        metavar="N",
        help="refuse new requests while N are waiting for the engine (default: no limit)",
    )
    serve.add_argument(
        "--stream-interval",
        type=parse_stream_interval,
        default=1,
        metavar="N",
        help="output tokens (1-64) a stream gathers before sending them, after the first "
        "token (vLLM's flag; larger: fewer events, less API-server work per token; default 1)",
    )
    serve.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="/metrics also lists every series under vLLM's vllm: prefix (for routers and "
        "endpoint pickers that read vllm:num_requests_waiting, vllm:kv_cache_usage_perc)",
    )
    serve.add_argument(
        "--max-tokens-policy",
        choices=MAX_TOKENS_POLICIES,
        default=ServerConfig.max_tokens_policy,
        help="a max_tokens past the room the prompt leaves in the context: clamp lowers it "
        "to that room (llama.cpp's and Ollama's behaviour; the output then ends with "
        "finish_reason length), strict refuses the request with a 400 as vLLM does "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--generation-config",
        default=ServerConfig.generation_config,
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for requests that leave fields unset: auto reads the model "
        "folder's generation_config.json, vllm ignores it, a FOLDER reads its own (its "
        "max_new_tokens then caps every request) (vLLM's flag; default %(default)s)",
    )
    serve.add_argument(
        "--override-generation-config",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="generation-config keys laid over --generation-config, e.g. "
        '\'{"temperature": 0.7, "max_new_tokens": 512}\' (max_new_tokens here caps every '
        "request's output) (vLLM's flag)",
    )
    serve.add_argument(
        "--max-logprobs",
        type=parse_non_negative_int,
        default=ServerConfig.max_logprobs,
        metavar="N",
        help="largest logprobs / top_logprobs a request may ask for",
    )
    serve.add_argument(
        "--request-body-timeout",
        type=parse_seconds,
        default=ServerConfig.request_body_timeout,
        metavar="SECONDS",
        help="a request body that takes longer to arrive gets 408 and its connection is "
        "closed (default %(default)s)",
    )
    serve.add_argument(
        "--max-choices",
        type=parse_positive_int,
        default=RequestLimits.max_choices,
        metavar="N",
        help="most choices (prompts x n) in one request (default %(default)s)",
    )
    serve.add_argument(
        "--max-chat-messages",
        type=parse_positive_int,
        default=RequestLimits.max_chat_messages,
        metavar="N",
        help="most messages in one chat request (default %(default)s)",
    )
    serve.add_argument(
        "--max-stop-strings",
        type=parse_positive_int,
        default=RequestLimits.max_stop_strings,
        metavar="N",
        help="most stop strings in one request (default %(default)s)",
    )
    serve.add_argument(
        "--max-stop-string-length",
        type=parse_positive_int,
        default=RequestLimits.max_stop_string_length,
        metavar="CHARS",
        help="longest stop string, in characters (default %(default)s)",
    )
    serve.add_argument(
        "--detokenizer-mode",
        choices=DETOKENIZER_MODES,
        default=ServerConfig.detokenizer_mode,
        help="detokenize in the API server (inline) or in a third process (process)",
    )
    serve.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help=f"least severe log messages shown, in every process (default ${LOG_LEVEL_ENV}, "
        "else info)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed arguments into a `ServerConfig` (raises ValueError on bad combinations)."""
    model = args.model or args.model_tag or DEFAULT_MODEL
    engine = engine_config(
        model=model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        model_impl=args.model_impl,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        runner=args.runner,
        max_model_len=args.max_model_len,
        download_dir=args.download_dir,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        num_threads=None if args.num_threads == "auto" else args.num_threads,
        adaptive_threads=True if args.num_threads == "auto" else None,
    )
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        shutdown_timeout=args.shutdown_timeout,
        engine_restart=args.engine_restart,
        restart=RestartPolicy(
            max_restarts=args.engine_restart_max,
            window=args.engine_restart_window,
            wait=args.engine_restart_wait,
        ),
        engine_step_timeout=args.engine_step_timeout or None,
        api_key=args.api_key if args.api_key is not None else default_api_key(),
        chat_template=read_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        disable_additional_properties=args.structured_outputs_config.get(
            "disable_additional_properties", True
        ),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_bytes,
        max_num_waiting_requests=args.max_num_waiting_requests,
        stream_interval=args.stream_interval,
        max_logprobs=args.max_logprobs,
        vllm_metric_names=args.vllm_metric_names,
        max_tokens_policy=args.max_tokens_policy,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        request_body_timeout=args.request_body_timeout,
        limits=RequestLimits(
            max_choices=args.max_choices,
            max_chat_messages=args.max_chat_messages,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
        ),
        detokenizer_mode=args.detokenizer_mode,
        data_parallel_size=args.data_parallel_size,
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``trio-llm`` console script; exits with the server's status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        log_level = resolve_log_level(args.log_level)
    except ValueError as exc:
        parser.error(str(exc))
    os.environ[LOG_LEVEL_ENV] = log_level  # the children inherit it
    configure_logging(log_level)

    import trio

    from trio_llm.errors import EngineDeadError, ModelNotFoundError
    from trio_llm.model_loader import locate_model
    from trio_llm.supervisor import check_bindable, serve

    try:
        # Fail in a second, not after the model has loaded.
        locate_model(config.engine.model.model)
        check_bindable(config.host, config.port)
    except (ModelNotFoundError, OSError) as exc:
        print(f"trio-llm: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        lifecycle = trio.run(serve, config)
    except BaseExceptionGroup as group:
        expected, rest = group.split((EngineDeadError, OSError))
        if expected is None or rest is not None:
            raise
        print(f"trio-llm: error: {first_leaf(expected)}", file=sys.stderr, flush=True)
        sys.exit(1)
    if lifecycle.exit_code:
        print(f"trio-llm: error: {lifecycle.reason}", file=sys.stderr, flush=True)
    else:
        print(f"trio-llm: stopped ({lifecycle.reason})", file=sys.stderr, flush=True)
    sys.exit(lifecycle.exit_code)
