"""`AcceptErrorFilter`: Trio's accept loop, out of file descriptors, logs one line a second."""

from __future__ import annotations

import errno
import io
import logging
from collections.abc import Iterator

import pytest
import trio

from trio_llm.api.http import connection_guard
from trio_llm.api.http.connection_guard import ACCEPT_LOGGER, AcceptErrorFilter


class _ExhaustedListener(trio.abc.Listener[trio.SocketStream]):
    """A listener whose every accept fails as ``accept(2)`` does without a free descriptor."""

    def __init__(self) -> None:
        self.num_accepts = 0

    async def accept(self) -> trio.SocketStream:
        self.num_accepts += 1
        await trio.lowlevel.checkpoint()
        raise OSError(errno.EMFILE, "Too many open files")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@pytest.fixture
def accept_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """Trio's accept logger with a handler writing to a string (put back afterwards)."""
    logger = logging.getLogger(ACCEPT_LOGGER)
    saved = list(logger.filters)
    output = io.StringIO()
    handler = logging.StreamHandler(output)
    logger.addHandler(handler)
    try:
        yield logger, output
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = saved


async def _handler(stream: trio.SocketStream) -> None:
    raise AssertionError("nothing is ever accepted")


async def _serve_for(seconds: float, listener: _ExhaustedListener) -> None:
    with trio.move_on_after(seconds):
        await trio.serve_listeners(_handler, [listener])


async def test_a_failing_accept_is_logged_once_a_second_without_traceback(
    accept_log: tuple[logging.Logger, io.StringIO], autojump_clock: trio.abc.Clock
) -> None:
    logger, output = accept_log
    logger.addFilter(AcceptErrorFilter(clock=trio.current_time))
    listener = _ExhaustedListener()
    await _serve_for(3.05, listener)
    lines = output.getvalue().splitlines()
    assert listener.num_accepts >= 30  # Trio retries every 0.1 s
    assert 3 <= len(lines) <= 4, lines
    assert all(line.startswith("accept returned EMFILE (Too many open files)") for line in lines)
    assert "more like it not shown" in lines[1]
    assert "Traceback" not in output.getvalue()


async def test_without_the_filter_trio_logs_a_traceback_each_retry(
    accept_log: tuple[logging.Logger, io.StringIO], autojump_clock: trio.abc.Clock
) -> None:
    """What the filter is for (and that the fake listener fails as the real one does)."""
    logger, output = accept_log
    logger.filters[:] = [f for f in logger.filters if not isinstance(f, AcceptErrorFilter)]
    await _serve_for(1.05, _ExhaustedListener())
    assert output.getvalue().count("Traceback") >= 10


def test_the_filter_is_installed_once(accept_log: tuple[logging.Logger, io.StringIO]) -> None:
    logger, _ = accept_log
    connection_guard._install_accept_error_filter()  # what `install` does last
    connection_guard._install_accept_error_filter()
    assert sum(isinstance(f, AcceptErrorFilter) for f in logger.filters) == 1
