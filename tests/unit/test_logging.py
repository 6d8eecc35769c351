"""Logging: the --log-level flag, $TRIO_LLM_LOG_LEVEL, the line format, and library etiquette."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from trio_llm.cli.main import build_parser, main
from trio_llm.logging_setup import (
    LOG_LEVEL_ENV,
    configure_logging,
    line_prefix,
    resolve_log_level,
)
from trio_llm.server.supervisor import _hypercorn_config
from trio_llm.server_config import ServerConfig


@pytest.fixture
def package_logger() -> Iterator[logging.Logger]:
    """The ``trio_llm`` logger, put back as it was after the test."""
    package = logging.getLogger("trio_llm")
    saved = (list(package.handlers), package.level, package.propagate)
    try:
        yield package
    finally:
        package.handlers[:] = saved[0]
        package.setLevel(saved[1])
        package.propagate = saved[2]


def _capture(package: logging.Logger) -> io.StringIO:
    """Point the handler `configure_logging` installed at a buffer."""
    (handler,) = package.handlers
    assert isinstance(handler, logging.StreamHandler)
    buffer = io.StringIO()
    handler.setStream(buffer)
    return buffer


@pytest.mark.parametrize("flag", ["debug", "INFO", "Warning", "error", "critical"])
def test_the_flag_takes_vllm_like_level_names(flag: str) -> None:
    args = build_parser().parse_args(["serve", "--log-level", flag])
    assert args.log_level == flag.lower()


def test_the_flag_defaults_to_none_and_refuses_unknown_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert build_parser().parse_args(["serve"]).log_level is None
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--log-level", "verbose"])
    assert caught.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_the_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert resolve_log_level() == "info"
    monkeypatch.setenv(LOG_LEVEL_ENV, "")
    assert resolve_log_level() == "info"
    monkeypatch.setenv(LOG_LEVEL_ENV, "DEBUG")
    assert resolve_log_level() == "debug"
    assert resolve_log_level("error") == "error"
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match=LOG_LEVEL_ENV):
        resolve_log_level()
    assert resolve_log_level("warning") == "warning"


def test_lines_keep_the_prefix_of_their_component(package_logger: logging.Logger) -> None:
    configure_logging("info")
    buffer = _capture(package_logger)
    logging.getLogger("trio_llm.server.supervisor").info("shutting down: received SIGTERM")
    logging.getLogger("trio_llm.model_files.loader").info("loading /m (torch.float32, cpu)")
    logging.getLogger("trio_llm.engine.loop").error("engine start-up failed: no")
    logging.getLogger("trio_llm.detokenizer.process").warning("a connection broke: eof")
    assert buffer.getvalue().splitlines() == [
        "trio-llm: shutting down: received SIGTERM",
        "trio-llm: loading /m (torch.float32, cpu)",
        "trio-llm engine: engine start-up failed: no",
        "trio-llm detokenizer: a connection broke: eof",
    ]
    assert line_prefix("trio_llm.engineering") == "trio-llm"


def test_the_level_filters_and_a_second_call_replaces_the_handler(
    package_logger: logging.Logger,
) -> None:
    configure_logging("info")
    configure_logging("warning")
    assert len(package_logger.handlers) == 1
    buffer = _capture(package_logger)
    log = logging.getLogger("trio_llm.server.supervisor")
    log.debug("not shown")
    log.info("not shown either")
    log.warning("closed 1 client connections that were not reading")
    assert buffer.getvalue() == "trio-llm: closed 1 client connections that were not reading\n"

    configure_logging("debug")
    buffer = _capture(package_logger)
    logging.getLogger("trio_llm.engine.loop").debug("engine core 1: starting m")
    assert buffer.getvalue() == "trio-llm engine: engine core 1: starting m\n"


def test_a_traceback_follows_its_line(package_logger: logging.Logger) -> None:
    configure_logging("info")
    buffer = _capture(package_logger)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("trio_llm.api.chat.streaming").exception("internal error")
    first, second, *rest = buffer.getvalue().splitlines()
    assert first == "trio-llm: internal error"
    assert second == "Traceback (most recent call last):"
    assert rest[-1] == "RuntimeError: boom"


def test_children_without_a_valid_level_log_at_info(
    package_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The children call configure_logging() with no level: the environment decides, and
    a bad value there must not keep an engine from starting."""
    monkeypatch.setenv(LOG_LEVEL_ENV, "ERROR")
    assert configure_logging() == "error"
    assert package_logger.level == logging.ERROR
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    assert configure_logging() == "info"
    assert package_logger.level == logging.INFO


def test_the_cli_passes_its_level_to_the_children_through_the_environment(
    package_logger: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The flag wins over $TRIO_LLM_LOG_LEVEL, and the CLI writes its choice back there
    for the engine and detokenizer children (a missing model stops it before any)."""
    monkeypatch.setenv(LOG_LEVEL_ENV, "error")
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model", "/nonexistent/model", "--log-level", "debug"])
    assert caught.value.code == 1
    assert package_logger.level == logging.DEBUG
    assert os.environ[LOG_LEVEL_ENV] == "debug"
    assert capsys.readouterr().err.startswith("trio-llm: error: ")


def test_a_bad_level_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model", "/nonexistent/model"])
    assert caught.value.code == 2
    assert LOG_LEVEL_ENV in capsys.readouterr().err


def test_hypercorn_logs_warnings_unless_the_level_is_higher(
    package_logger: logging.Logger,
) -> None:
    configure_logging("debug")
    assert _hypercorn_config(ServerConfig()).loglevel == "WARNING"
    configure_logging("error")
    assert _hypercorn_config(ServerConfig()).loglevel == "ERROR"


@pytest.mark.slow  # a subprocess
def test_importing_trio_llm_installs_no_handler() -> None:
    """Library etiquette: `open_engine` / `LLM` users keep their own logging setup."""
    code = (
        "import logging, trio_llm, trio_llm.async_engine, trio_llm.llm\n"
        "import trio_llm.server.supervisor\n"
        "print(len(logging.getLogger().handlers), len(logging.getLogger('trio_llm').handlers))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["0", "0"]
