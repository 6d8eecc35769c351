"""Streamed responses: ``chat.completion.chunk`` / ``text_completion`` server-sent events.

The protocol, as OpenAI and vLLM send it: every chunk of one response has the same
``id``, ``created`` and ``model``; a chat choice's first chunk has ``delta.role``
("assistant") and later ones do not; ``finish_reason`` is null on intermediate chunks and
set on each choice's last one; with ``stream_options.include_usage`` one more chunk with
empty ``choices`` and the ``usage`` totals comes last; ``data: [DONE]`` always ends the
stream, also after an error, which is sent as a ``data: {"error": {...}}`` event.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import trio

from trio_llm.api.disconnect import Emit
from trio_llm.api.errors import engine_error, error_body
from trio_llm.api.plan import Plan, run_choices
from trio_llm.errors import EngineError
from trio_llm.frontend.engine_client import Admission, EngineClient
from trio_llm.text.choice import Choice, ChoiceDelta

logger = logging.getLogger(__name__)


class Stream:
    """One streamed response over all of a request's choices, in ``plan.format``.

    Args:
        admission: places reserved in the waiting line; released when the stream ends.
    """

    def __init__(
        self,
        engine: EngineClient,
        plan: Plan,
        choices: list[Choice],
        admission: Admission,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.choices = choices
        self.admission = admission
        self._lock = trio.Lock()
        self._emit: Emit | None = None

    def _chunk(self, entries: list[dict[str, Any]], choices: list[Choice] | None = None) -> str:
        return json.dumps(self.plan.format.chunk(self.plan, entries, choices), ensure_ascii=False)

    async def _send(self, data: str) -> None:
        assert self._emit is not None
        async with self._lock:  # choices stream concurrently; events must not interleave
            await self._emit(data)

    async def _on_delta(self, choice: Choice, piece: ChoiceDelta) -> None:
        entry = self.plan.format.chunk_choice(self.plan, choice, piece)
        if entry is not None:
            await self._send(self._chunk([entry]))

    async def run(self, emit: Emit, *, include_usage: bool) -> None:
        """Emit every chunk, then ``[DONE]``; an engine error becomes an error event."""
        self._emit = emit
        plan = self.plan
        try:
            for opening in plan.format.opening_choices(plan, self.choices):
                await self._send(self._chunk([opening]))
            await run_choices(self.engine, plan, self.choices, self.admission, self._on_delta)
            if include_usage:
                await self._send(self._chunk([], self.choices))
        except EngineError as exc:
            error = engine_error(exc)
            await self._send(
                json.dumps(error_body(error.message, error.type, error.param, error.code))
            )
        except Exception as exc:  # a bug: still end the stream properly, and say so
            logger.exception("internal error in a streamed response")
            message = f"internal error: {type(exc).__name__}: {exc}"
            await self._send(json.dumps(error_body(message, "server_error")))
        finally:
            self.engine.release(self.admission)
        await self._send("[DONE]")
