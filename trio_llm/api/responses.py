"""``POST /v1/responses``: the stateless part of OpenAI's Responses API, as another output
format of chat.

A Responses request is translated into a `ChatCompletionRequest`
(`ResponsesRequest.to_chat`) and runs the one chat path; only the rendering differs
(`ResponsesFormat`): a ``response`` object whose ``output`` holds a ``message`` item
(``output_text``) and ``function_call`` items, and a stream of typed events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` or ``response.incomplete``), each
with a ``sequence_number``.

Supported: ``input`` (a string, or message items with ``input_text`` / ``output_text``
parts, ``function_call`` and ``function_call_output`` items), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p`` (and vLLM's ``top_k``), ``text.format``
(``text``, ``json_object``, ``json_schema``), function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``stream``, ``metadata``, ``user``. Nothing is stored:
``store: true``, ``previous_response_id``, ``conversation`` and ``background`` are
refused with a 400 naming the field, as are built-in tools and non-text inputs.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from trio_llm.api.errors import APIError, bad_request, validation_message
from trio_llm.api.formats import Block, BlockFormat, Event
from trio_llm.api.protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    ChatTranslated,
    FiniteFloat,
    Text,
    check_json_text,
)
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.plan import Plan


class FunctionTool(BaseModel):
    """``{"type": "function", "name", "description", "parameters", "strict"}``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    """``text``: ``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""

    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] | None = None


#: Fields of a stateful or background response; refused unless absent, null or false.
_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")

#: Input item types this server takes (messages, and the two halves of a tool call).
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class ResponsesRequest(ChatTranslated):
    """``POST /v1/responses`` (OpenAI's field names; see the module doc)."""

    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\bmessages\b", "input"),
        (r"\bmax_tokens\b", "max_output_tokens"),
        (r"\bresponse_format\b", "text"),
        (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    )

    model: Text | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: FiniteFloat | None = Field(default=None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: Text | None = None

    def _check_supported(self) -> None:
        if self.store:
            raise bad_request(
                "store: true is not supported: this server keeps no responses (send "
                "store: false, and the whole conversation as input)",
                "store",
            )
        extra = self.model_extra or {}
        for name in _STATEFUL:
            if extra.get(name) is not None and extra.get(name) is not False:
                raise bad_request(
                    f"`{name}` is not supported: this server keeps no responses or "
                    "conversations (send the whole conversation as input)",
                    name,
                )
        reasoning = extra.get("reasoning")
        if reasoning is not None and (
            not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none")
        ):
            raise bad_request("reasoning is not supported by the model served here", "reasoning")
        # Echoed in the response as given: they must be valid Unicode to the last key.
        echoed = {"metadata": self.metadata, "tools": self.tools, "text": self.text}
        echoed["tool_choice"] = self.tool_choice
        for name, value in echoed.items():
            if value is not None:
                dumped = value.model_dump() if isinstance(value, BaseModel) else value
                check_json_text(dumped, name)
        calls = any(
            isinstance(item, dict) and item.get("type") in ("function_call", "function_call_output")
            for item in (self.input if isinstance(self.input, list) else ())
        )
        if calls and not self.tools:
            raise bad_request(
                "input with function_call or function_call_output items needs the tools the "
                "calls used in `tools` (the chat template shows calls only with their tools)",
                "tools",
            )

    def to_chat(self) -> ChatCompletionRequest:
        """The chat-completion request this Responses request asks for.

        Raises:
            APIError: a 400 naming the Responses field at fault.
        """
        self._check_supported()
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for i, item in enumerate(self.input):
                _add_item(messages, item, i)
        if not messages:
            raise bad_request("input must hold at least one message", "input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or "name" not in self.tool_choice:
                raise bad_request(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", '
                    '"name": ...}',
                    "tool_choice",
                )
            name = self.tool_choice["name"]
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        return self.validated_chat(body, "input")

    def _response_format(self) -> dict[str, Any] | None:
        form = self.text.format if self.text is not None else None
        if form is None or form.get("type") == "text":
            return None
        if form.get("type") == "json_object":
            return {"type": "json_object"}
        if form.get("type") == "json_schema" and isinstance(form.get("name"), str):
            schema = {"name": form["name"], "schema": form.get("schema", {})}
            schema["strict"] = form.get("strict") is True
            return {"type": "json_schema", "json_schema": schema}
        raise bad_request(
            "text.format must be {type: text}, {type: json_object} or {type: json_schema, "
            "name, schema, strict}",
            "text",
        )


def _text(content: Any, where: str) -> str:
    """A message item's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise bad_request(
                f"{where}: content parts of type {kind!r} are not supported: the model served "
                "here takes text only (input_text parts)",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """Append one input item to the chat ``messages`` (a function call joins the
    assistant message before it, as a chat turn holds all its calls)."""
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind not in _ITEM_TYPES:
        raise bad_request(f"{where}: items of type {kind!r} are not supported", "input")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"{where}.role must be user, system, developer or assistant", "input")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
        return
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.call_id must be a string", "input")
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, where)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        return
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"{where}: a function_call needs a name and arguments", "input")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant":
        last["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(
            f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}", "tools"
        )
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as exc:
        message, _ = validation_message(RequestValidationError(exc.errors()))
        raise bad_request(f"tools[{i}]: {message}", "tools") from exc
    return {
        "type": "function",
        "function": {
            "name": function.name,
            "description": function.description,
            "parameters": function.parameters,
            "strict": function.strict,
        },
    }


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
            return {
                "type": "function_call",
                "id": self._item_id(block),
                "call_id": block.call_id,
                "name": block.name,
                "arguments": "" if status == "in_progress" else block.text,
                "status": status,
            }
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
        request = self.request
        incomplete = None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        usage = None
        if choice is not None:
            prompt = sum(plan.prompt_lengths)
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
                "output_tokens": choice.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + choice.num_output_tokens,
            }
        return {
            "id": plan.response_id,
            "object": "response",
            "created_at": plan.created or int(time.time()),
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": plan.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": (request.text.format if request.text else None) or {"type": "text"}},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": request.tools or [],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
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

    def stream_failed(self, plan: Plan, error: APIError) -> list[Event]:
        """The whole stream of a response that failed before any output: created,
        in progress, then ``response.failed`` with ``error`` (its ``code`` and
        ``message``): how OpenAI streams a context overflow, and where Codex looks for
        ``context_length_exceeded``."""
        events = self.stream_start(plan, [])
        response = self._response(plan, "failed", [])
        response["error"] = {"code": error.code, "message": error.message}
        return [*events, self._event("response.failed", response=response)]

    def stream_error(self, error: APIError) -> Event:
        return self._event("error", code=error.code, message=error.message, param=error.param)
