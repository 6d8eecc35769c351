"""Logging for the process entry points: one format, one level, in every process.

Every module logs through ``logger = logging.getLogger(__name__)``; nothing in the package
installs a handler on import, so programs that embed trio_llm (`open_engine`, `LLM`) keep
their own logging configuration (without one, Python's last-resort handler still prints
warnings and errors to stderr).

The entry points call `configure_logging` once: ``trio-llm serve`` (`trio_llm.cli.main`) and
the two children it spawns, ``python -m trio_llm.engine`` and ``python -m
trio_llm.detokenizer``. It gives the ``trio_llm`` logger one stderr handler that writes
``PREFIX: message`` (the traceback follows on the next lines when there is one), with the
prefix naming the component of the logging module:

- ``trio-llm engine`` for ``trio_llm.engine.*`` (the engine core),
- ``trio-llm detokenizer`` for ``trio_llm.detokenizer.*``,
- ``trio-llm`` for everything else (API server, supervisor, model loader).

So the lines a user sees at the default level ("info") are the ones trio-llm always
printed, e.g. ``trio-llm: engine ready (...)``, ``trio-llm: shutting down: received
SIGTERM``, ``trio-llm engine: engine start-up failed: ...``; ``--log-level debug`` adds
the debug lines, ``warning`` / ``error`` / ``critical`` leave out the less severe ones.

The level comes from ``trio-llm serve --log-level``, else from ``$TRIO_LLM_LOG_LEVEL``,
else "info". The CLI writes the level it chose into ``$TRIO_LLM_LOG_LEVEL`` before it
starts any child, so the children (which inherit the environment) log at the same level.
"""

from __future__ import annotations

import logging
import os
import sys

#: Environment variable holding the log level (read by every entry point; the flag wins).
LOG_LEVEL_ENV = "TRIO_LLM_LOG_LEVEL"
#: Accepted level names, as ``--log-level`` spells them (case-insensitive).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LOG_LEVEL = "info"

#: Logger-name prefix -> the prefix of its lines; the first match wins.
_PREFIXES = (
    ("trio_llm.engine", "trio-llm engine"),
    ("trio_llm.detokenizer", "trio-llm detokenizer"),
)
_DEFAULT_PREFIX = "trio-llm"


def line_prefix(logger_name: str) -> str:
    """The prefix of a log line from ``logger_name`` ("trio-llm engine", "trio-llm", ...)."""
    for package, prefix in _PREFIXES:
        if logger_name == package or logger_name.startswith(package + "."):
            return prefix
    return _DEFAULT_PREFIX


class PrefixFormatter(logging.Formatter):
    """``PREFIX: message`` with the prefix from `line_prefix` (and the traceback after)."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return f"{line_prefix(record.name)}: {super().format(record)}"


def parse_log_level(text: str) -> str:
    """A level name of `LOG_LEVELS` (any case) -> its lower-case form.

    Raises:
        ValueError: not one of `LOG_LEVELS`.
    """
    level = text.strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"not a log level ({', '.join(LOG_LEVELS)}): {text!r}")
    return level


def resolve_log_level(flag: str | None = None) -> str:
    """``flag`` if given, else ``$TRIO_LLM_LOG_LEVEL`` if set and not empty, else "info".

    Raises:
        ValueError: the one chosen is not a level name.
    """
    if flag is not None:
        return parse_log_level(flag)
    from_env = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if from_env:
        try:
            return parse_log_level(from_env)
        except ValueError:
            raise ValueError(
                f"${LOG_LEVEL_ENV} must be one of {', '.join(LOG_LEVELS)}, not {from_env!r}"
            ) from None
    return DEFAULT_LOG_LEVEL


def configure_logging(level: str | None = None) -> str:
    """Set up the ``trio_llm`` logger of an entry point; returns the level name used.

    ``level`` None means ``$TRIO_LLM_LOG_LEVEL`` (an unknown name there falls back to
    "info", with a warning). Calling it again replaces the handler it installed before.
    """
    bad_env = None
    if level is None:
        try:
            level = resolve_log_level()
        except ValueError as exc:
            bad_env, level = exc, DEFAULT_LOG_LEVEL
    else:
        level = parse_log_level(level)
    package = logging.getLogger("trio_llm")
    for handler in list(package.handlers):
        if getattr(handler, "_trio_llm_handler", False):
            package.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrefixFormatter())
    handler._trio_llm_handler = True  # type: ignore[attr-defined]
    package.addHandler(handler)
    package.setLevel(level.upper())
    package.propagate = False  # each line once, in our format, whatever the root has
    if bad_env is not None:
        logging.getLogger(__name__).warning("%s; logging at %s", bad_env, level)
    return level
