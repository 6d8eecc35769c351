"""``POST /v1/messages``: the Anthropic Messages API, as another output format of chat.

A Messages request is translated into a `ChatCompletionRequest` (`MessagesRequest.to_chat`)
and runs the one chat path: the same validation, chat template, tool-call parser, output
constraints, admission and disconnect handling. Only the rendering differs
(`trio_llm.api.anthropic.format.MessagesFormat`): a ``message`` object with ``text`` and
``tool_use`` content blocks, and a stream of named events (``message_start``,
``content_block_start``, ``content_block_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``). Errors use Anthropic's body (``{"type": "error",
"error": {"type", "message"}}``, see `trio_llm.api.http.errors.anthropic_error_body`).

Supported: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use``,
``tool_result``, ``thinking`` and ``redacted_thinking`` blocks and ``role: "system"``
turns (`trio_llm.api.anthropic.blocks`), ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``tools`` (client tools with an
``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``,
``disable_parallel_tool_use``), ``output_config`` (``format``: structured output, a JSON
Schema; ``effort``), ``thinking``, ``context_management`` (its edits that clear old
thinking and old tool results are applied to the prompt,
`trio_llm.api.anthropic.context_editing`), ``stream`` and ``metadata``. ``thinking`` and
``effort`` are kept for the reasoning support (`TranslatedAsks`); on a model without
reasoning they change nothing. Images, documents and server tools are refused with a 400
naming the field. Field names and shapes follow Anthropic's API reference.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from trio_llm.api.anthropic.blocks import (
    Message,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trio_llm.api.anthropic.context_editing import ContextManagement, apply_context_edits
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.request_body import INT32_MAX, FiniteFloat, Text
from trio_llm.api.chat.translated import ChatTranslated, TokenCounter
from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.parsing import CountedFields


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


#: Request fields of the Messages API this server does not implement, refused unless
#: absent or null.
_UNSUPPORTED = ("container", "mcp_servers")


class MessagesRequest(ChatTranslated):
    """``POST /v1/messages`` (Anthropic's field names; see the module doc)."""

    ENDPOINT: ClassVar[str] = "/v1/messages"

    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\btools\[(\d+)\]\.function\.parameters\b", r"tools[\1].input_schema"),
        (r"\bresponse_format\b", "output_config"),
        (r"\bstop\b(?= |$|:)", "stop_sequences"),
        (r"\bparallel_tool_calls\b", "tool_choice"),
        (r"\bcontinue_final_message\b", "messages"),
    )
    COUNTED_FIELDS: ClassVar[CountedFields] = CountedFields(
        messages="messages", stop="stop_sequences"
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

    def thinking_requested(self) -> bool | None:
        """``thinking`` of type ``disabled`` is False, ``enabled`` or ``adaptive`` True
        (``output_config.effort`` says how much, not whether: it changes nothing here)."""
        kind = self.thinking.type if self.thinking is not None else None
        if kind == "disabled":
            return False
        return True if kind in ("enabled", "adaptive") else None

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
            **self._format_fields(),
            **self._tool_fields(),
        }
        chat = self.validated_chat(body, "messages")
        chat.translated.fold_late_system = True
        if self.thinking is not None:
            chat.translated.thinking = self.thinking.model_dump(exclude_none=True)
        chat.translated.effort = self.output_config.effort if self.output_config else None
        return chat

    def _format_fields(self) -> dict[str, Any]:
        """The chat ``response_format`` of ``output_config.format`` (none without one)."""
        form = self.output_config.format if self.output_config else None
        if form is None:
            return {}
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            raise bad_request(
                'output_config.format must be {"type": "json_schema", "schema": {...}}',
                "output_config",
            )
        # Anthropic's structured outputs are always held to the schema: strict.
        schema = {"name": "output", "schema": form.get("schema", {}), "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}

    def _tool_fields(self) -> dict[str, Any]:
        """The chat ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of this
        request's ``tools`` and ``tool_choice``."""
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [
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
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``;
    answered with the prompt's token count (``{"input_tokens": N}``), the
    ``usage.input_tokens`` the same request to ``/v1/messages`` would report."""

    ENDPOINT: ClassVar[str] = "/v1/messages/count_tokens"

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
