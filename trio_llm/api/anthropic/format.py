"""The Anthropic Messages rendering of a chat response (`MessagesFormat`): a ``message``
object with ``text``, ``thinking`` and ``tool_use`` content blocks, and a stream of named
events (``message_start``, ``content_block_start``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``; a ``ping`` while the stream
is silent)."""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Any

from trio_llm.api.chat.format import Block, BlockFormat, Event
from trio_llm.api.http.errors import APIError
from trio_llm.api.tools.calls import decode_model_json
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.chat.planner import Plan


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: Anthropic's clients expect one (and send it
    back with the block); this server makes an opaque one from the block's text (the
    SHA-256 of it, in hex) and checks none."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


#: Chat finish reasons as Messages ``stop_reason``\ s ("stop" is end_turn or, when a stop
#: sequence matched, stop_sequence; "length" is model_context_window_exceeded where the
#: output filled the context, `_stop`).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesFormat(BlockFormat):
    """Renders a chat response as an Anthropic ``message`` (see the module doc)."""

    id_prefix = "msg"
    object = "message"
    done_marker = None
    #: message_start reports the prompt-cache hits, which the engine's first output
    #: has (it comes when the engine first schedules the request, before the prefill
    #: ends); then a ``ping`` whenever the stream is silent for a while, as Anthropic's
    #: API sends them, so a client's idle timeout (Claude Code's: 300 s) does not end a
    #: stream whose prompt takes minutes to prefill.
    start_after_first_output = True
    keepalive_event: Event | None = ("ping", {"type": "ping"})

    def new_id(self) -> str:
        return f"msg_{uuid.uuid4().hex[:24]}"

    def _usage(self, plan: Plan, choices: list[Choice]) -> dict[str, int]:
        """Anthropic's ``usage``: ``input_tokens`` (the prompt tokens not read from the
        cache), ``cache_creation_input_tokens`` (always 0: the prefix cache fills itself,
        no write is billed), ``cache_read_input_tokens`` (prompt tokens read from the
        prefix cache) and ``output_tokens``; the first three add up to the prompt."""
        cached = sum(choice.num_cached_tokens for choice in choices)
        return {
            "input_tokens": sum(plan.prompt_lengths) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": sum(choice.num_output_tokens for choice in choices),
        }

    @staticmethod
    def _stop(
        plan: Plan, choice: Choice, finish_reason: str | None
    ) -> tuple[str | None, str | None]:
        """``stop_reason`` and ``stop_sequence``. An output cut at its ``max_tokens`` is
        ``max_tokens`` when the request's own limit or the server's (the model's maximum
        on this server: ``--override-generation-config``'s ``max_new_tokens``) set it,
        as Anthropic's API defines it, and ``model_context_window_exceeded`` when the
        room the prompt left in the context did (Anthropic's reason for a ``max_tokens``
        past the context window; Claude Code then says the context is full)."""
        if finish_reason == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        if finish_reason == "length" and plan.output_bound(choice.index) == "context":
            return "model_context_window_exceeded", None
        return _STOP_REASONS.get(finish_reason or "", finish_reason), None

    def _message(self, plan: Plan, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": plan.response_id,
            "type": "message",
            "role": "assistant",
            "model": plan.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
        }

    @staticmethod
    def _content(block: Block, whole: bool) -> dict[str, Any]:
        if block.kind == "text":
            return {"type": "text", "text": block.text if whole else ""}
        if block.kind == "thinking":
            if not whole:
                return {"type": "thinking", "thinking": "", "signature": ""}
            signature = thinking_signature(block.text)
            return {"type": "thinking", "thinking": block.text, "signature": signature}
        arguments: Any = {}
        if whole and block.text:
            try:
                arguments = decode_model_json(block.text)
            except ValueError:  # cut off by max_tokens (stop_reason says so), or too deep
                arguments = {}
        return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": arguments}

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        (choice,) = choices
        blocks, finish_reason = self.blocks(plan, choice)
        body = self._message(plan, [self._content(block, True) for block in blocks])
        body["stop_reason"], body["stop_sequence"] = self._stop(plan, choice, finish_reason)
        body["usage"] = self._usage(plan, choices)
        return body

    def stream_start(self, plan: Plan, choices: list[Choice]) -> list[Event]:
        message = self._message(plan, [])
        message["usage"] = {**self._usage(plan, choices), "output_tokens": 0}
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
        ]

    def block_started(self, plan: Plan, block: Block) -> list[Event]:
        data = {
            "type": "content_block_start",
            "index": block.index,
            "content_block": self._content(block, False),
        }
        return [("content_block_start", data)]

    def block_delta(self, plan: Plan, block: Block, text: str) -> list[Event]:
        if block.kind == "text":
            delta = {"type": "text_delta", "text": text}
        elif block.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        data = {"type": "content_block_delta", "index": block.index, "delta": delta}
        return [("content_block_delta", data)]

    def block_stopped(self, plan: Plan, block: Block) -> list[Event]:
        events: list[Event] = []
        if block.kind == "thinking":  # its signature comes last, as Anthropic sends it
            delta = {"type": "signature_delta", "signature": thinking_signature(block.text)}
            data = {"type": "content_block_delta", "index": block.index, "delta": delta}
            events.append(("content_block_delta", data))
        stop = {"type": "content_block_stop", "index": block.index}
        return [*events, ("content_block_stop", stop)]

    def message_finished(self, plan: Plan, choice: Choice, finish_reason: str) -> list[Event]:
        stop_reason, stop_sequence = self._stop(plan, choice, finish_reason)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": choice.num_output_tokens},
        }
        return [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def stream_end(self, plan: Plan, choices: list[Choice], *, include_usage: bool) -> list[Event]:
        return []

    def stream_error(self, error: APIError) -> Event:
        return ("error", error.anthropic_body())
