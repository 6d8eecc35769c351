"""The Responses API rendering of a chat response (`ResponsesFormat`): a ``response``
object whose ``output`` holds ``reasoning``, ``message`` and ``function_call`` items, and
the stream of typed events with their ``sequence_number`` (see `trio_llm.api.responses.request`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from trio_llm.api.chat.format import Block, BlockFormat, Event
from trio_llm.api.http.errors import APIError
from trio_llm.api.responses.request import ReasoningConfig, ResponsesRequest
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.chat.planner import Plan


#: The stream events that end a response, each carrying the whole response object.
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def responses_format(request: ResponsesRequest) -> Callable[..., ResponsesFormat]:
    """What makes ``request``'s format (`ModelServing.plan_as`'s ``make_format``)."""
    return partial(ResponsesFormat, request=request)


class ResponsesFormat(BlockFormat):
    """Renders a chat response as a Responses API ``response`` (see the module doc).

    Args:
        request: the Responses request, echoed in the response (``instructions``,
            ``tools``, ``text``, sampling fields), as OpenAI does.
    """

    id_prefix = "resp"
    object = "response"
    done_marker = None

    def __init__(self, *args: Any, request: ResponsesRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request = request
        self._sequence = 0
        self._item_ids: dict[int, str] = {}
        self._done_items: list[dict[str, Any]] = []

    def new_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    def _item_id(self, block: Block) -> str:
        if block.index not in self._item_ids:
            prefix = {"text": "msg", "call": "fc", "thinking": "rs"}[block.kind]
            self._item_ids[block.index] = f"{prefix}_{uuid.uuid4().hex}"
        return self._item_ids[block.index]

    def _item(self, block: Block, status: str) -> dict[str, Any]:
        if block.kind == "thinking":  # a reasoning item, its text whole (no summary)
            content = [] if status == "in_progress" else [self._reasoning_part(block.text)]
            return {
                "type": "reasoning",
                "id": self._item_id(block),
                "summary": [],
                "content": content,
                "status": status,
            }
        if block.kind == "call":
            item = {
                "type": "function_call",
                "id": self._item_id(block),
                "call_id": block.call_id,
                "name": block.name,
                "arguments": "" if status == "in_progress" else block.text,
                "status": status,
            }
            # A namespace's function: its namespace and own name, as the client knows it.
            namespace, name = self.request.offered_tools.client_names.get(
                block.name or "", (None, block.name)
            )
            if namespace is not None:
                item["name"], item["namespace"] = name, namespace
            return item
        parts = [] if status == "in_progress" else [self._part(block.text)]
        return {
            "type": "message",
            "id": self._item_id(block),
            "status": status,
            "role": "assistant",
            "content": parts,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _reasoning_part(text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text}

    def _response(
        self,
        plan: Plan,
        status: str,
        output: list[dict[str, Any]],
        choice: Choice | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object, its fields in the order of OpenAI's Response object;
        ``usage`` once ``choice`` has ended; ``finish_reason`` ``length`` makes it
        ``incomplete``."""
        request = self.request
        incomplete = None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        reasoning = request.reasoning or ReasoningConfig()
        conversation = request.conversation_id
        text: dict[str, Any] = {
            "format": (request.text.format if request.text else None) or {"type": "text"},
            "verbosity": (request.text.verbosity if request.text else None) or "medium",
        }
        return {
            "id": plan.response_id,
            "object": "response",
            "created_at": plan.created or int(time.time()),
            "status": status,
            "background": bool(request.background),
            "completed_at": int(time.time()) if status == "completed" else None,
            "conversation": None if conversation is None else {"id": conversation},
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "model": plan.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "prompt_cache_retention": request.prompt_cache_retention,
            "reasoning": {
                "effort": reasoning.effort,
                "summary": reasoning.summary or reasoning.generate_summary,
            },
            "safety_identifier": request.safety_identifier,
            "service_tier": "default",
            "store": request.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": text,
            # OpenAI's default, echoed with or without tools.
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_logprobs": 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None if choice is None else self._usage(plan, choice),
            "user": request.user,
            "metadata": request.metadata or {},
        }

    @staticmethod
    def _usage(plan: Plan, choice: Choice) -> dict[str, Any]:
        """The Responses ``usage`` of a choice (its prompt, cache hits and output)."""
        prompt = sum(plan.prompt_lengths)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": choice.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": choice.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + choice.num_output_tokens,
        }

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        (choice,) = choices
        blocks, finish_reason = self.blocks(plan, choice)
        output = [self._item(block, "completed") for block in blocks]
        if output and finish_reason == "length":  # the last item was cut off
            output[-1]["status"] = "incomplete"
        return self._response(plan, "completed", output, choice, finish_reason)

    def _event(self, kind: str, **fields: Any) -> Event:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return (kind, data)

    def stream_start(self, plan: Plan, choices: list[Choice]) -> list[Event]:
        response = self._response(plan, "in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def block_started(self, plan: Plan, block: Block) -> list[Event]:
        events = [
            self._event(
                "response.output_item.added",
                output_index=block.index,
                item=self._item(block, "in_progress"),
            )
        ]
        if block.kind != "call":
            part = self._part("") if block.kind == "text" else self._reasoning_part("")
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._item_id(block),
                    output_index=block.index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def block_delta(self, plan: Plan, block: Block, text: str) -> list[Event]:
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if block.kind == "call":
            return [self._event("response.function_call_arguments.delta", **where, delta=text)]
        if block.kind == "thinking":
            return [
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            ]
        return [
            self._event(
                "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
            )
        ]

    def block_stopped(self, plan: Plan, block: Block) -> list[Event]:
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if block.kind == "call":
            events = [
                self._event("response.function_call_arguments.done", **where, arguments=block.text)
            ]
        elif block.kind == "thinking":
            events = [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=block.text
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=self._reasoning_part(block.text),
                ),
            ]
        else:
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=block.text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=self._part(block.text),
                ),
            ]
        item = self._item(block, "incomplete" if self.finish_reason == "length" else "completed")
        events.append(self._event("response.output_item.done", output_index=block.index, item=item))
        self._done_items.append(item)
        return events

    def message_finished(self, plan: Plan, choice: Choice, finish_reason: str) -> list[Event]:
        response = self._response(plan, "completed", self._done_items, choice, finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def stream_end(self, plan: Plan, choices: list[Choice], *, include_usage: bool) -> list[Event]:
        return []

    def status_response(
        self, plan: Plan, status: str, error: APIError | None = None
    ) -> dict[str, Any]:
        """The response object with no output yet (``queued``, ``in_progress``), or
        ``failed`` with ``error`` (its ``code`` and ``message``)."""
        response = self._response(plan, status, [])
        if error is not None:
            response["error"] = {"code": error.code, "message": error.message}
        return response

    def stream_failed(self, plan: Plan, error: APIError) -> list[Event]:
        """The whole stream of a response that failed before any output: created,
        in progress, then ``response.failed`` with ``error`` (its ``code`` and
        ``message``): how OpenAI streams a context overflow, and where Codex looks for
        ``context_length_exceeded``."""
        events = self.stream_start(plan, [])
        response = self.status_response(plan, "failed", error)
        return [*events, self._event("response.failed", response=response)]

    def final_body(self, event: Event) -> dict[str, Any] | None:
        name, data = event
        return data["response"] if name in FINAL_EVENTS else None

    def stream_error(self, error: APIError) -> Event:
        return self._event("error", code=error.code, message=error.message, param=error.param)
