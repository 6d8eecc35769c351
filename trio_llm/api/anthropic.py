"""``POST /v1/messages``: the Anthropic Messages API, as another output format of chat.

A Messages request is translated into a `ChatCompletionRequest` (`MessagesRequest.to_chat`)
and runs the one chat path: the same validation, chat template, tool-call parser, output
constraints, admission and disconnect handling. Only the rendering differs
(`MessagesFormat`): a ``message`` object with ``text`` and ``tool_use`` content blocks, and
a stream of named events (``message_start``, ``content_block_start``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``).
Errors use Anthropic's body (``{"type": "error", "error": {"type", "message"}}``, see
`trio_llm.api.errors.anthropic_error_body`).

Supported: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use``,
``tool_result``, ``thinking`` and ``redacted_thinking`` blocks and ``role: "system"``
turns, ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``,
``tools`` (client tools with an ``input_schema``), ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``, ``disable_parallel_tool_use``), ``output_config`` (``format``:
structured output, a JSON Schema; ``effort``), ``thinking``, ``context_management``
(its edits that clear old thinking and old tool results are applied to the prompt,
`apply_context_edits`), ``stream`` and ``metadata``. ``thinking`` and ``effort`` are kept
for the reasoning support (`TranslatedAsks`); on a model without reasoning they change
nothing. Images, documents and server tools are refused with a 400 naming the field.
Field names and shapes follow Anthropic's API reference.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from trio_llm.api.errors import APIError, bad_request
from trio_llm.api.formats import Block, BlockFormat
from trio_llm.api.protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    ChatTranslated,
    FiniteFloat,
    Text,
)
from trio_llm.api.response_format import Event
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.response_format import Plan


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


class ThinkingBlock(BaseModel):
    """The reasoning of an earlier assistant turn (``signature`` is not checked)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(BaseModel):
    """Encrypted reasoning of an earlier assistant turn: never shown to the model here."""

    model_config = ConfigDict(extra="allow")

    type: Literal["redacted_thinking"]
    data: Text = ""


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]

#: Content block types this server takes; any other is refused by name.
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

#: What a cleared tool result says instead (Claude Code's own words for one it cleared).
CLEARED_TOOL_RESULT = "[Old tool result content cleared]"


class Message(BaseModel):
    """One turn: ``role`` user, assistant or system (a system message at that place of
    the conversation), ``content`` a string or content blocks."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
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


class ThinkingConfig(BaseModel):
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}``, ``{"type": "adaptive"}``
    or ``{"type": "disabled"}`` (other keys, such as ``display``, are ignored)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('thinking of type "enabled" needs budget_tokens')
        return self


class OutputConfig(BaseModel):
    """``output_config``: ``format`` (structured output) and ``effort``."""

    model_config = ConfigDict(extra="allow")

    format: Any = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


Count = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class InputTokens(BaseModel):
    """``{"type": "input_tokens", "value": N}``: a number of prompt tokens."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_tokens"]
    value: Count


class ToolUses(BaseModel):
    """``{"type": "tool_uses", "value": N}``: a number of tool uses."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_uses"]
    value: Count


class ThinkingTurns(BaseModel):
    """``{"type": "thinking_turns", "value": N}``: a number of assistant turns with
    thinking."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["thinking_turns"]
    value: Count


class ClearToolUses(BaseModel):
    """The ``clear_tool_uses_20250919`` edit (Anthropic's "context editing"): once the
    prompt passes ``trigger``, the results of all tool uses but the last ``keep`` (those
    of ``exclude_tools`` aside) are replaced by `CLEARED_TOOL_RESULT`, and with
    ``clear_tool_inputs`` (all, or the tools named) the calls' inputs by ``{}``; unless
    that clears fewer than ``clear_at_least`` tokens."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] = InputTokens(
        type="input_tokens", value=100_000
    )
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[Text] | None = None
    clear_tool_inputs: StrictBool | list[Text] = False


class ClearThinking(BaseModel):
    """The ``clear_thinking_20251015`` edit: the thinking of all assistant turns but the
    last ``keep`` that have any is dropped (``"all"`` keeps every one)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns = ThinkingTurns(type="thinking_turns", value=1)


ContextEdit = Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]


class ContextManagement(BaseModel):
    """``context_management``: the ``edits`` applied to the prompt, in order."""

    model_config = ConfigDict(extra="forbid")

    edits: list[ContextEdit] = Field(default_factory=list)


#: Counts a chat request's prompt tokens (its template and tokenizer).
TokenCounter = Callable[[ChatCompletionRequest], int]

#: Request fields of the Messages API this server does not implement, refused unless
#: absent or null.
_UNSUPPORTED = ("container", "mcp_servers")


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
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None

    def _check_supported(self) -> None:
        extra = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name) is not None:
                raise bad_request(f"`{name}` is not supported by this server", name)
        config = self.output_config
        unknown = sorted(set(config.model_extra or {})) if config is not None else []
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

    def to_chat(self, count_tokens: TokenCounter | None = None) -> ChatCompletionRequest:
        """The chat-completion request this Messages request asks for, with the
        ``context_management`` edits applied (`apply_context_edits`).

        Args:
            count_tokens: counts a chat request's prompt tokens; needed only when an edit
                has a condition on input tokens (``trigger``, ``clear_at_least``).

        Raises:
            APIError: a 400 naming the Messages field at fault.
        """
        self._check_supported()
        edits = self.context_management.edits if self.context_management else []

        def count(turns: list[Message]) -> int:
            if count_tokens is None:
                raise TypeError("an edit on input tokens needs to_chat(count_tokens=...)")
            return count_tokens(self._chat(turns))

        return self._chat(apply_context_edits(self.messages, edits, count))

    def _chat(self, turns: list[Message]) -> ChatCompletionRequest:
        """The chat-completion request of this request with ``turns`` as its messages."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for turn in turns:
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
        form = self.output_config.format if self.output_config else None
        if form is not None:
            if not isinstance(form, dict) or form.get("type") != "json_schema":
                raise bad_request(
                    'output_config.format must be {"type": "json_schema", "schema": {...}}',
                    "output_config",
                )
            # Anthropic's structured outputs are always held to the schema: strict.
            schema = {"name": "output", "schema": form.get("schema", {}), "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                        # As given (left out when not): the template shows it.
                        "strict": (tool.model_extra or {}).get("strict"),
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
        chat = self.validated_chat(body, "messages")
        chat.translated.fold_late_system = True
        if self.thinking is not None:
            chat.translated.thinking = self.thinking.model_dump(exclude_none=True)
        chat.translated.effort = self.output_config.effort if self.output_config else None
        return chat


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``;
    answered with the prompt's token count (``{"input_tokens": N}``), the
    ``usage.input_tokens`` the same request to ``/v1/messages`` would report."""

    max_tokens: StrictInt = Field(default=1, ge=1, le=INT32_MAX)


def _chat_messages(turn: Message) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become ``tool`` messages (before
    the turn's text), tool calls the assistant message's ``tool_calls``, an assistant
    turn's thinking its ``reasoning_content`` (for the reasoning support; chat templates
    without it do not show it), redacted thinking nothing."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    text = "".join(block.text for block in turn.content if isinstance(block, TextBlock))
    calls = [block for block in turn.content if isinstance(block, ToolUseBlock)]
    results = [block for block in turn.content if isinstance(block, ToolResultBlock)]
    thinking = [block.thinking for block in turn.content if isinstance(block, ThinkingBlock)]
    if turn.role != "assistant" and any(
        isinstance(block, ThinkingBlock | RedactedThinkingBlock) for block in turn.content
    ):
        raise bad_request("thinking blocks belong in assistant turns", "messages")
    if turn.role == "system":
        if calls or results:
            raise bad_request("a system turn in `messages` takes text only", "messages")
        return [{"role": "system", "content": text}]
    if turn.role == "assistant":
        if results:
            raise bad_request("tool_result blocks belong in user turns", "messages")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["reasoning_content"] = "\n\n".join(thinking)
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


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: Anthropic's clients expect one (and send it
    back with the block); this server makes an opaque one from the block's text (the
    SHA-256 of it, in hex) and checks none."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


def apply_context_edits(
    turns: list[Message], edits: list[ContextEdit], count_tokens: Callable[[list[Message]], int]
) -> list[Message]:
    """``turns`` with ``edits`` applied in order, as Anthropic's context editing applies
    them before the prompt reaches the model (the client keeps the whole conversation).

    Without a `ClearThinking` edit, the thinking of all assistant turns but the last one
    with thinking is dropped (Anthropic's default, ``keep: {"type": "thinking_turns",
    "value": 1}``). Redacted thinking is never shown to the model here either way.

    Args:
        turns: the request's messages (left unchanged; edited turns are copies).
        edits: ``context_management.edits``.
        count_tokens: the prompt tokens of a conversation (called only for conditions
            on input tokens).
    """
    if not any(isinstance(edit, ClearThinking) for edit in edits):
        turns = _clear_thinking(turns, 1)
    for edit in edits:
        if isinstance(edit, ClearThinking):
            turns = _clear_thinking(turns, None if edit.keep == "all" else edit.keep.value)
        else:
            turns = _clear_tool_uses(turns, edit, count_tokens)
    return turns


def _has_thinking(turn: Message) -> bool:
    return turn.role == "assistant" and any(
        isinstance(block, ThinkingBlock | RedactedThinkingBlock)
        for block in (() if isinstance(turn.content, str) else turn.content)
    )


def _clear_thinking(turns: list[Message], keep: int | None) -> list[Message]:
    """The thinking blocks of all assistant turns but the last ``keep`` with thinking
    dropped (None: all kept)."""
    if keep is None:
        return turns
    with_thinking = [i for i, turn in enumerate(turns) if _has_thinking(turn)]
    cleared = set(with_thinking[: max(len(with_thinking) - keep, 0)])
    return [
        turn.model_copy(
            update={
                "content": [
                    block
                    for block in turn.content
                    if not isinstance(block, ThinkingBlock | RedactedThinkingBlock)
                ]
            }
        )
        if i in cleared
        else turn
        for i, turn in enumerate(turns)
    ]


def _clear_tool_uses(
    turns: list[Message], edit: ClearToolUses, count_tokens: Callable[[list[Message]], int]
) -> list[Message]:
    """`ClearToolUses` applied to ``turns`` (unchanged when it does not trigger, has
    nothing to clear, or would clear fewer than ``clear_at_least`` tokens)."""
    uses = [
        block
        for turn in turns
        if turn.role == "assistant" and not isinstance(turn.content, str)
        for block in turn.content
        if isinstance(block, ToolUseBlock)
    ]
    before: int | None = None
    if isinstance(edit.trigger, ToolUses):
        if len(uses) <= edit.trigger.value:
            return turns
    else:
        before = count_tokens(turns)
        if before <= edit.trigger.value:
            return turns
    excluded = set(edit.exclude_tools or ())
    old = uses[: max(len(uses) - edit.keep.value, 0)]
    cleared = {use.id: use.name for use in old if use.name not in excluded}
    if not cleared:
        return turns
    inputs = edit.clear_tool_inputs
    clear_input = {
        call_id
        for call_id, name in cleared.items()
        if inputs is True or (isinstance(inputs, list) and name in inputs)
    }

    def edited(block: Any) -> Any:
        if isinstance(block, ToolResultBlock) and block.tool_use_id in cleared:
            return block.model_copy(update={"content": CLEARED_TOOL_RESULT})
        if isinstance(block, ToolUseBlock) and block.id in clear_input:
            return block.model_copy(update={"input": {}})
        return block

    after = [
        turn
        if isinstance(turn.content, str)
        else turn.model_copy(update={"content": [edited(block) for block in turn.content]})
        for turn in turns
    ]
    if edit.clear_at_least is not None:
        if before is None:
            before = count_tokens(turns)
        if before - count_tokens(after) < edit.clear_at_least.value:
            return turns
    return after


#: Chat finish reasons as Messages ``stop_reason``\ s ("stop" is end_turn or, when a stop
#: sequence matched, stop_sequence).
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
        if block.kind == "thinking":
            if not whole:
                return {"type": "thinking", "thinking": "", "signature": ""}
            signature = thinking_signature(block.text)
            return {"type": "thinking", "thinking": block.text, "signature": signature}
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
