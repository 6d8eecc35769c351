"""Command line: ``trio-llm serve [options]`` (flag names follow vLLM's)."""

from __future__ import annotations

import argparse
import re
import sys

from trio_llm.config import (
    CACHE_DIR_ENV,
    DEFAULT_MODEL,
    DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4294967296"``, ``"4GiB"``, ``"512M"`` -> bytes (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def parse_port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0 picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (0-65535): {text!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="trio-llm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_tag", nargs="?", help="same as --model")
    serve.add_argument(
        "--model", default=None, help=f"local HF folder, .gguf file, or {DEFAULT_MODEL} (default)"
    )
    serve.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use in `model`"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=parse_port, default=8000, help="0 picks a free port")
    serve.add_argument("--dtype", choices=DTYPES, default="auto", help="auto = float32 on CPU")
    serve.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    kv = serve.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None)
    kv.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--download-dir",
        default=None,
        help=f"converted-model cache (default ${CACHE_DIR_ENV} or ~/.cache/trio_llm)",
    )
    serve.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads in the engine (default: all cores)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for handlers and the engine at shutdown",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed arguments into a `ServerConfig` (raises ValueError on bad combinations)."""
    model = args.model or args.model_tag or DEFAULT_MODEL
    engine = EngineConfig(
        model=ModelConfig(
            model=model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            download_dir=args.download_dir,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        num_threads=args.num_threads,
    )
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        shutdown_timeout=args.shutdown_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``trio-llm`` console script; exits with the server's status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    import trio

    from trio_llm.frontend.engine_client import EngineDeadError
    from trio_llm.model_loader import ModelNotFoundError, locate_model
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
        print(f"trio-llm: error: {_first_leaf(expected)}", file=sys.stderr, flush=True)
        sys.exit(1)
    if lifecycle.exit_code:
        print(f"trio-llm: error: {lifecycle.reason}", file=sys.stderr, flush=True)
    else:
        print(f"trio-llm: stopped ({lifecycle.reason})", file=sys.stderr, flush=True)
    sys.exit(lifecycle.exit_code)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
