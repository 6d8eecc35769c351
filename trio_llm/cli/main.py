"""Command line: ``trio-llm serve [options]`` and ``trio-llm run-batch -i IN -o OUT
[options]`` (flag names follow vLLM's).

The flags are derived from the configuration dataclasses: `trio_llm.cli.serve_flags` says
which fields have one; their defaults and choices are the fields' own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from trio_llm.cli.serve_flags import FIELD_DEFAULT, SERVE_FLAGS, Flag
from trio_llm.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    engine_config,
)
from trio_llm.errors import first_leaf
from trio_llm.logging_setup import (
    LOG_LEVEL_ENV,
    LOG_LEVELS,
    configure_logging,
    resolve_log_level,
)
from trio_llm.server_config import (
    ModelsConfig,
    RequestLimits,
    RestartPolicy,
    ServerConfig,
    StoreConfig,
)

#: Annotations of the fields whose flag parses with ``int`` when the `Flag` names no type.
_INT_TYPES = ("int", "int | None")


def _option_name(spec: dataclasses.Field[Any], flag: Flag) -> str:
    """The flag of the field ``spec``: `Flag.name`, else ``--`` and the field's name."""
    return flag.name or "--" + spec.name.replace("_", "-")


def _field_default(spec: dataclasses.Field[Any]) -> Any:
    """The default value of the dataclass field ``spec``."""
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def _argument(spec: dataclasses.Field[Any], flag: Flag) -> dict[str, Any]:
    """The `argparse.ArgumentParser.add_argument` keywords of one field's flag."""
    default = _field_default(spec) if flag.default is FIELD_DEFAULT else flag.default
    if flag.nargs is not None and isinstance(default, tuple):
        default = list(default)
    kwargs: dict[str, Any] = {"default": default, "help": flag.help}
    if isinstance(default, bool) and flag.type is None:
        kwargs["action"] = "store_true" if not default else argparse.BooleanOptionalAction
        return kwargs
    kwargs["type"] = flag.type or (int if spec.type in _INT_TYPES else None)
    for key in ("metavar", "nargs", "action"):
        if getattr(flag, key) is not None:
            kwargs[key] = getattr(flag, key)
    if spec.metadata.get("choices") is not None:
        kwargs["choices"] = spec.metadata["choices"]
    return kwargs


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, flags: dict[str, Flag]
) -> None:
    """Add a flag for each field of the dataclass ``cls`` named in ``flags``, in a group
    titled by the class's name, in ``flags``' order.

    Raises:
        KeyError: ``flags`` names a field ``cls`` does not have.
    """
    specs = {spec.name: spec for spec in dataclasses.fields(cls)}
    group = parser.add_argument_group(cls.__name__)
    exclusive: dict[str, Any] = {}
    for name, flag in flags.items():
        spec = specs[name]
        target = group
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = group.add_mutually_exclusive_group()
            target = exclusive[flag.exclusive]
        target.add_argument(_option_name(spec, flag), *flag.aliases, **_argument(spec, flag))


def dataclass_values(args: argparse.Namespace, cls: type, flags: dict[str, Flag]) -> dict[str, Any]:
    """The values of the fields of ``cls`` named in ``flags``, from parsed ``args``
    (each through its `Flag.convert`; a list given for a tuple field becomes a tuple).

    Raises:
        ValueError: a `Flag.convert` refused its value (``--chat-template``).
    """
    specs = {spec.name: spec for spec in dataclasses.fields(cls)}
    values = {}
    for name, flag in flags.items():
        dest = _option_name(specs[name], flag).lstrip("-").replace("-", "_")
        value = getattr(args, dest)
        if isinstance(value, list) and isinstance(_field_default(specs[name]), tuple):
            value = tuple(value)
        values[name] = flag.convert(value) if flag.convert is not None else value
    return values


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="trio-llm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model_tag", nargs="?", help="same as --model")
    _add_serve_flags(serve)
    run_batch = commands.add_parser(
        "run-batch",
        help="run a file of batch requests (OpenAI's batch input format) offline, without a "
        "port, and write their results (the batch output-file format)",
    )
    run_batch.add_argument(
        "-i", "--input-file", required=True, help="the requests, one JSON line each (a local file)"
    )
    run_batch.add_argument(
        "-o", "--output-file", required=True, help="where the results go (a local file)"
    )
    run_batch.set_defaults(model_tag=None)
    _add_serve_flags(run_batch)
    return parser


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``serve`` (the model, the engine, the server) and ``--log-level``."""
    for cls, flags in SERVE_FLAGS.items():
        add_dataclass_arguments(parser, cls, flags)
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help=f"least severe log messages shown, in every process (default ${LOG_LEVEL_ENV}, "
        "else info)",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed arguments into a `ServerConfig` (raises ValueError on bad combinations)."""

    def values(cls: type) -> dict[str, Any]:
        return dataclass_values(args, cls, SERVE_FLAGS[cls])

    # The engine's fields first: their errors come before the server's (as they always did).
    models = _models(args)
    model = values(ModelConfig) | {"model": models.default}
    engine = engine_config(
        **model,
        **values(CacheConfig),
        **values(SchedulerConfig),
        **values(LoRAConfig),
        **values(EngineConfig),
        adaptive_threads=True if args.num_threads == "auto" else None,
    )
    return ServerConfig(
        engine=engine,
        restart=RestartPolicy(**values(RestartPolicy)),
        limits=RequestLimits(**values(RequestLimits)),
        store=StoreConfig(**values(StoreConfig)),
        models=ModelsConfig(flagged=models.flagged, **values(ModelsConfig)),
        **values(ServerConfig) | {"served_model_names": models.default_names},
    )


@dataclasses.dataclass(frozen=True)
class _Models:
    """What ``--model``, ``--served-model-name`` and ``--models-dir`` say: the default
    model and its names, and every ``--model`` with its names."""

    default: str
    default_names: tuple[str, ...]
    flagged: tuple[tuple[str, tuple[str, ...]], ...]


def _models(args: argparse.Namespace) -> _Models:
    """The models of ``args`` (`trio_llm.server.model_catalog`): the i-th ``--served-model-name``
    group names the i-th ``--model``; with ``--models-dir`` and no ``--model`` the
    folder's first model is the default.

    Raises:
        ValueError: more name groups than models, a name given twice, a models folder
            that is not one or holds no model.
    """
    from pathlib import Path

    from trio_llm.server.model_catalog import Catalog, flagged_entries

    groups = [tuple(group) for group in args.served_model_name or []]
    models = list(args.model or [])
    if args.model_tag is not None and not models:
        models = [args.model_tag]
    folder = getattr(args, "models_dir", None)
    if not models and folder is None:
        models = [DEFAULT_MODEL]
    entries = flagged_entries(models, groups)
    try:
        catalog = Catalog(entries, Path(folder).expanduser() if folder is not None else None)
    except NotADirectoryError as exc:
        raise ValueError(str(exc)) from None
    default = catalog.default
    groups += [()] * (len(models) - len(groups))  # a model without names: its string
    if not entries:  # the folder's first model
        return _Models(default.model, default.names, ())
    return _Models(default.model, groups[0], tuple(zip(models, groups, strict=True)))


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
    if args.command == "run-batch":
        sys.exit(_run_batch(config, args.input_file, args.output_file))

    import trio

    from trio_llm.errors import EngineDeadError, ModelNotFoundError
    from trio_llm.model_files.loader import locate_model
    from trio_llm.server.supervisor import check_bindable, serve
    from trio_llm.store import StoreError

    try:
        # Fail in a second, not after the model has loaded.
        for model in [model for model, _ in config.models.flagged] or [config.engine.model.model]:
            locate_model(model)
        check_bindable(config.host, config.port)
    except (ModelNotFoundError, OSError) as exc:
        print(f"trio-llm: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        lifecycle = trio.run(serve, config)
    except StoreError as exc:  # the store cannot be opened: before anything started
        print(f"trio-llm: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
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


def _run_batch(config: ServerConfig, input_file: str, output_file: str) -> int:
    """``trio-llm run-batch``: the exit status (1 with a one-line error on stderr)."""
    import trio

    from trio_llm.errors import EngineDeadError, ModelNotFoundError
    from trio_llm.model_files.loader import locate_model
    from trio_llm.server.run_batch import RunBatchError, check_paths, run_batch

    try:
        source, target = check_paths(input_file, output_file)
        for model in [model for model, _ in config.models.flagged] or [config.engine.model.model]:
            locate_model(model)
        summary = trio.run(run_batch, config, source, target)
    except (RunBatchError, ModelNotFoundError) as exc:
        print(f"trio-llm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseExceptionGroup as group:
        expected, rest = group.split((EngineDeadError, OSError, RunBatchError))
        if expected is None or rest is not None:
            raise
        print(f"trio-llm: error: {first_leaf(expected)}", file=sys.stderr, flush=True)
        return 1
    print(
        f"trio-llm: run-batch: {summary.total} lines, {summary.succeeded} succeeded, "
        f"{summary.failed} failed -> {target}",
        file=sys.stderr,
        flush=True,
    )
    return 0
