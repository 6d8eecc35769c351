"""Running batch lines until each has the answer that is its result (`LineRunner`):
shared by the server's batch runner (`trio_llm.api.batch.runner`) and ``trio-llm
run-batch`` (`trio_llm.server.run_batch`).

A line the engine could not answer because it failed or is restarting (a 5xx while an
engine failed or restarted, a 503) is run again once an engine serves, never recorded as
the line's failure; a 4xx answer is the line's failure, and so is a 5xx that comes back
`MAX_SERVER_ERRORS` times while the engine serves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio
from starlette.types import ASGIApp

from trio_llm.api.batch.lines import (
    LineError,
    LineRequest,
    answer_line,
    call_app,
    error_line,
)
from trio_llm.errors import EngineDeadError, EngineError
from trio_llm.frontend.handle import EngineState

logger = logging.getLogger(__name__)

#: Seconds before the first retry of a line the engine could not answer; the wait
#: doubles up to `RETRY_MAX`.
RETRY_MIN = 0.25
RETRY_MAX = 5.0
#: Server errors (5xx while the engine serves) a line gets before they are its result.
MAX_SERVER_ERRORS = 3
#: HTTP status of a request whose client left (`trio_llm.api.chat.serving`): not an answer.
CLIENT_CLOSED_REQUEST = 499


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """The request headers that carry the server's own API key (none without one)."""
    return {} if api_key is None else {"authorization": f"Bearer {api_key}"}


class LineRunner:
    """Runs batch lines through an ASGI app, each until it has an answer that is its
    result: retried while the engine fails or restarts.

    Args:
        app: the server's ASGI app.
        engine: the engines behind it (to tell an engine failure from an error): an
            `EngineHandle`, or `trio_llm.api.model_router.RouterEngines`.
        headers: request headers every line carries (`api_key_headers`).
        max_waiting: the server's ``--max-num-waiting-requests``: a line starts only
            while fewer than half that many requests wait for the engine, so batch
            lines never fill the waiting line interactive requests need. None: no limit.
    """

    def __init__(
        self,
        app: ASGIApp,
        engine: EngineState,
        headers: Mapping[str, str],
        max_waiting: int | None = None,
    ) -> None:
        self.app = app
        self.engine = engine
        self.headers = dict(headers)
        self.waiting_room = None if max_waiting is None else max(1, max_waiting // 2)

    def _restarts(self) -> int:
        return sum(client.num_restarts for client in self.engine.engines)

    def _engine_failed(self) -> bool:
        return any(client.error is not None for client in self.engine.engines)

    async def _engine_back(self) -> None:
        """Return once an engine serves.

        Raises:
            EngineDeadError: no engine serves any more, for good.
        """
        while not self.engine.is_alive:
            if self.engine.ended.is_set():
                raise self.engine.error or EngineDeadError("the engine has stopped")
            # The engine handle has no event for "serving again": look again shortly.
            await trio.sleep(RETRY_MIN)

    async def _room(self) -> None:
        """Return once fewer requests wait for the engine than `waiting_room`."""
        # Admission has no event for "a place came free": look again shortly.
        while self.waiting_room is not None and self.engine.num_waiting >= self.waiting_room:  # noqa: ASYNC110
            await trio.sleep(RETRY_MIN)

    async def run(self, request: LineRequest) -> tuple[bool, str]:
        """Run ``request`` (``POST`` to its url); return whether it succeeded and its
        line of the output or error file (`answer_line`).

        Raises:
            EngineDeadError: the engine stopped for good before the line had an answer.
        """
        server_errors = 0
        delay = RETRY_MIN
        while True:
            await self._engine_back()
            await self._room()
            restarts = self._restarts()
            answer = await call_app(self.app, request.url, request.body, headers=self.headers)
            if answer.status < 500 and answer.status != CLIENT_CLOSED_REQUEST:
                return answer_line(request, answer)
            engine_failure = (
                answer.status in (503, CLIENT_CLOSED_REQUEST)
                or self._restarts() != restarts
                or self._engine_failed()
            )
            if not engine_failure:
                server_errors += 1
                if server_errors >= MAX_SERVER_ERRORS:
                    return answer_line(request, answer)
            logger.debug(
                f"batch line {request.custom_id!r}: HTTP {answer.status}, tried again "
                f"in {delay:g} s"
            )
            await trio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)


async def run_line(lines: LineRunner, parsed: LineRequest | LineError) -> tuple[bool, str]:
    """The result of one parsed input line: run it, or the error line of a line that
    cannot run. An unexpected error while it runs is that line's result (`failed_line`),
    never its batch's end.

    Raises:
        EngineError: no engine serves any more, for good (the line has no result yet).
    """
    if isinstance(parsed, LineError):
        return False, error_line(parsed.custom_id, parsed.code, parsed.message)
    try:
        return await lines.run(parsed)
    except EngineError:
        raise
    except Exception:
        logger.exception(f"batch line {parsed.index + 1} ({parsed.custom_id!r}) failed")
        return False, failed_line(parsed.custom_id)


#: The error of a line that met an unexpected error (the log has the details).
INTERNAL_ERROR = (
    "the server failed on this request (an internal error, in the server's log); the "
    "batch's other requests are not affected"
)


def failed_line(custom_id: str | None) -> str:
    """The error-file line of a line that met an unexpected error: OpenAI's
    ``internal_error``, without the error's own text (no internals in a result)."""
    return error_line(custom_id, "internal_error", INTERNAL_ERROR)


class Wakeup:
    """Wakes the tasks waiting on it (a new batch, a cancel); each waits at most a
    timeout, so work another server put in a shared store is found too."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        """Wake every task waiting now."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self, seconds: float) -> None:
        """Return when woken, or after ``seconds``."""
        event = self._event
        with trio.move_on_after(seconds):
            await event.wait()
