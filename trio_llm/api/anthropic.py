"""``POST /v1/messages``: the Anthropic Messages API, as another output format of chat.

A Messages request is translated into a `ChatCompletionRequest` (`MessagesRequest.to_chat`)
and runs the one chat path: the same validation, chat template, tool-call parser, output
constraints, admission and disconnect handling. Only the rendering differs
(`MessagesFormat`): a ``message`` object with ``text`` and ``tool_use`` content blocks, and
a stream of named events (``message_start``, ``content_block_start``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``).
Errors use Anthropic's body (``{"type": "error", "error": {"type", "message"}}``, see
`trio_llm.api.errors.anthropic_error_body`).

Supported: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use`` and
``tool_result`` blocks, ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, ``tools`` (client tools with an ``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``, ``disable_parallel_tool_use``), ``output_config.format``
(structured output: a JSON Schema), ``stream`` and ``metadata``.
Images, documents, extended thinking and server tools are refused with a 400 naming the
field. Field names and shapes follow Anthropic's API reference.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from trio_llm.api.errors import APIError, bad_request
from trio_llm.api.formats import Block, BlockFormat, Event
from trio_llm.api.protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    ChatTranslated,
    FiniteFloat,
    Text,
)
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.plan import Plan


class TextBlock(BaseModel):
    """``{"type": "text", "text": ...}`` (``cache_control`` and ``citations`` ignored)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = ConfigDict(extra="allow")

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A tool's result, in a user turn, for the call ``tool_use_id``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        """The result as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]

#: Content block types this server takes; any other is refused by name.
_BLOCK_TYPES = ("text", "tool_use", "tool_result")


class Message(BaseModel):
    """One turn: ``role`` user or assistant, ``content`` a string or content blocks."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuse block types other than text, tool_use and tool_result (images,
        documents, thinking) by name, not as a union mismatch."""
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported: the model served "
                    f"here takes text only ({', '.join(_BLOCK_TYPES)} blocks)"
                )
        return data


class Tool(BaseModel):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON Schema).
    Server tools (a ``type`` other than ``custom``) are refused in `MessagesRequest`."""

    model_config = ConfigDict(extra="allow")

    name: Text
    description: Text | None = None
    input_schema: dict[str, Any] | None = None
    type: Text | None = None


class ToolChoice(BaseModel):
    """``{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: StrictBool = False


#: Request fields of the Messages API this server does not implement, refused unless
#: absent or null (``thinking`` may also say ``{"type": "disabled"}``).
_UNSUPPORTED = ("container", "mcp_servers", "context_management")


class MessagesRequest(ChatTranslated):
    """``POST /v1/messages`` (Anthropic's field names; see the module doc)."""

    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\btools\[(\d+)\]\.function\.parameters\b", r"tools[\1].input_schema"),
        (r"\bresponse_format\b", "output_config"),
        (r"\bstop\b(?= |$|:)", "stop_sequences"),
        (r"\bparallel_tool_calls\b", "tool_choice"),
        (r"\bcontinue_final_message\b", "messages"),
    )

    model: Text
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1, le=INT32_MAX)
    system: Text | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    temperature: FiniteFloat | None = Field(default=None, ge=0, le=1)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def _check_supported(self) -> None:
        extra = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name) is not None:
                raise bad_request(f"`{name}` is not supported by this server", name)
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise bad_request(
                "extended thinking is not supported by the model served here", "thinking"
            )
        config = self.output_config or {}
        if config.get("effort") is not None:
            raise bad_request(
                "output_config.effort is not supported by the model served here", "output_config"
            )
        unknown = sorted(set(config) - {"effort", "format"})
        if unknown:
            raise bad_request(f"output_config: {unknown} are not supported", "output_config")
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}]: server tools ({tool.type}) are not supported; give client "
                    "tools (name, description, input_schema)",
                    "tools",
                )
            if tool.input_schema is None:
                raise bad_request(f"tools[{i}].input_schema is required", "tools")
        uses_tools = any(
            isinstance(block, ToolUseBlock | ToolResultBlock)
            for turn in self.messages
            if not isinstance(turn.content, str)
            for block in turn.content
        )
        if uses_tools and not self.tools:
            raise bad_request(
                "messages with tool_use or tool_result blocks need the tools they used in "
                "`tools` (the chat template shows calls only with their tools)",
                "tools",
            )

    def to_chat(self) -> ChatCompletionRequest:
        """The chat-completion request this Messages request asks for.

        Raises:
            APIError: a 400 naming the Messages field at fault.
        """
        self._check_supported()
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for turn in self.messages:
            messages += _chat_messages(turn)
        last = messages[-1]
        # A final assistant turn is a prefill: the answer continues it (Anthropic's rule).
        prefill = last["role"] == "assistant" and "tool_calls" not in last
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
            "continue_final_message": prefill,
        }
        form = (self.output_config or {}).get("format")
        if form is not None:
            if not isinstance(form, dict) or form.get("type") != "json_schema":
                raise bad_request(
                    'output_config.format must be {"type": "json_schema", "schema": {...}}',
                    "output_config",
                )
            schema = {"name": "output", "schema": form.get("schema", {})}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if choice.name is None:
                    raise bad_request('tool_choice of type "tool" needs a name', "tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return self.validated_chat(body, "messages")


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``;
    answered with the prompt's token count (``{"input_tokens": N}``), the
    ``usage.input_tokens`` the same request to ``/v1/messages`` would report."""

    max_tokens: StrictInt = Field(default=1, ge=1, le=INT32_MAX)


def _chat_messages(turn: Message) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become ``tool`` messages (before
    the turn's text), tool calls the assistant message's ``tool_calls``."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    text = "".join(block.text for block in turn.content if isinstance(block, TextBlock))
    calls = [block for block in turn.content if isinstance(block, ToolUseBlock)]
    results = [block for block in turn.content if isinstance(block, ToolResultBlock)]
    if turn.role == "assistant":
        if results:
            raise bad_request("tool_result blocks belong in user turns", "messages")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
                for call in calls
            ]
        return [message]
    if calls:
        raise bad_request("tool_use blocks belong in assistant turns", "messages")
    out = [
        {"role": "tool", "tool_call_id": result.tool_use_id, "content": result.text()}
        for result in results
    ]
    if text or not results:
        out.append({"role": "user", "content": text})
    return out


#: Chat finish reasons as Messages ``stop_reason``\ s ("stop" is end_turn or, when a stop
#: sequence matched, stop_sequence).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesFormat(BlockFormat):
    """Renders a chat response as an Anthropic ``message`` (see the module doc)."""

    id_prefix = "msg"
    object = "message"
    done_marker = None
    #: message_start reports the prompt-cache hits, which the engine's first output has.
    start_after_first_output = True

    def new_id(self) -> str:
        return f"msg_{uuid.uuid4().hex[:24]}"

    def _usage(self, plan: Plan, choices: list[Choice]) -> dict[str, int]:
        # Anthropic counts cache reads apart from input_tokens (their sum is the prompt).
        cached = sum(choice.num_cached_tokens for choice in choices)
        return {
            "input_tokens": sum(plan.prompt_lengths) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": sum(choice.num_output_tokens for choice in choices),
        }

    @staticmethod
    def _stop(choice: Choice, finish_reason: str | None) -> tuple[str | None, str | None]:
        """``stop_reason`` and ``stop_sequence``."""
        if finish_reason == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
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
        arguments: Any = {}
        if whole and block.text:
            try:
                arguments = json.loads(block.text)
            except ValueError:  # a call cut off by max_tokens (stop_reason says so)
                arguments = {}
        return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": arguments}

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        (choice,) = choices
        blocks, finish_reason = self.blocks(plan, choice)
        body = self._message(plan, [self._content(block, True) for block in blocks])
        body["stop_reason"], body["stop_sequence"] = self._stop(choice, finish_reason)
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
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        data = {"type": "content_block_delta", "index": block.index, "delta": delta}
        return [("content_block_delta", data)]

    def block_stopped(self, plan: Plan, block: Block) -> list[Event]:
        return [("content_block_stop", {"type": "content_block_stop", "index": block.index})]

    def message_finished(self, plan: Plan, choice: Choice, finish_reason: str) -> list[Event]:
        stop_reason, stop_sequence = self._stop(choice, finish_reason)
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
