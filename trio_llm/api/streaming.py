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
from trio_llm.api.generation import Plan, run_choices, usage
from trio_llm.api.logprobs_format import CompletionLogprobs, chat_logprobs
from trio_llm.errors import EngineError
from trio_llm.frontend.engine_client import Admission, EngineClient
from trio_llm.text.choice import Choice, ChoiceDelta
from trio_llm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Stream:
    """One streamed response over all of a request's choices.

    Args:
        admission: places reserved in the waiting line; released when the stream ends.
    """

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        plan: Plan,
        choices: list[Choice],
        admission: Admission,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.plan = plan
        self.choices = choices
        self.admission = admission
        self._lock = trio.Lock()
        self._emit: Emit | None = None
        self._started: set[int] = set()
        self._formatters = {c.index: CompletionLogprobs(tokenizer) for c in choices}

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        plan = self.plan
        body: dict[str, Any] = {
            "id": plan.response_id,
            "object": plan.kind.chunk_object,
            "created": plan.created,
            "model": plan.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return json.dumps(body, ensure_ascii=False)

    async def _send(self, data: str) -> None:
        assert self._emit is not None
        async with self._lock:  # choices stream concurrently; events must not interleave
            await self._emit(data)

    def _chat_choice(self, choice: Choice, piece: ChoiceDelta) -> dict[str, Any]:
        delta: dict[str, str] = {}
        if piece.text or piece.finish_reason is None:
            delta["content"] = piece.text
        logprobs = None
        if self.plan.num_top_logprobs is not None and piece.logprobs:
            logprobs = chat_logprobs(self.tokenizer, piece.logprobs, self.plan.num_top_logprobs)
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
            "stop_reason": piece.stop_reason,
        }

    def _completion_choice(self, choice: Choice, piece: ChoiceDelta) -> dict[str, Any]:
        text = piece.text
        entries: list = list(piece.logprobs)
        first_token = 0
        if self.plan.echo and choice.index not in self._started:
            # The prompt (and its logprobs) goes out with the choice's first chunk.
            text = (self.plan.echo_texts[choice.index] or "") + text
            entries = [None, *choice.prompt_logprobs, *entries]
            first_token = self.plan.requests[choice.index][0][0]
        logprobs = None
        if self.plan.num_top_logprobs is not None:
            logprobs = self._formatters[choice.index].delta(entries, first_token)
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
            "stop_reason": piece.stop_reason,
        }

    async def _on_delta(self, choice: Choice, piece: ChoiceDelta) -> None:
        if self.plan.kind.chat:
            body = self._chat_choice(choice, piece)
        else:
            body = self._completion_choice(choice, piece)
        self._started.add(choice.index)
        await self._send(self._chunk([body]))

    async def run(self, emit: Emit, *, include_usage: bool) -> None:
        """Emit every chunk, then ``[DONE]``; an engine error becomes an error event."""
        self._emit = emit
        try:
            if self.plan.kind.chat:
                for choice in self.choices:
                    role = {"index": choice.index, "delta": {"role": "assistant", "content": ""}}
                    await self._send(
                        self._chunk(
                            [{**role, "logprobs": None, "finish_reason": None, "stop_reason": None}]
                        )
                    )
            await run_choices(self.engine, self.plan, self.choices, self.admission, self._on_delta)
            if include_usage:
                await self._send(self._chunk([], usage(self.plan, self.choices)))
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
