"""Anthropic's context editing (``context_management.edits``): the edits that clear old
thinking and old tool results from a Messages conversation before the prompt reaches the
model (the client keeps the whole conversation). Field names and defaults follow
Anthropic's API reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from trio_llm.api.anthropic.blocks import (
    Message,
    RedactedThinkingBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trio_llm.api.chat.request_body import INT32_MAX, Text

#: What a cleared tool result says instead (Claude Code's own words for one it cleared).
CLEARED_TOOL_RESULT = "[Old tool result content cleared]"


class _Count(BaseModel):
    """``{"type": ..., "value": N}``: a count of something (``type`` says what)."""

    model_config = ConfigDict(extra="forbid")

    type: str
    value: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


class InputTokens(_Count):
    """``{"type": "input_tokens", "value": N}``: a number of prompt tokens."""

    type: Literal["input_tokens"]


class ToolUses(_Count):
    """``{"type": "tool_uses", "value": N}``: a number of tool uses."""

    type: Literal["tool_uses"]


class ThinkingTurns(_Count):
    """``{"type": "thinking_turns", "value": N}``: a number of assistant turns with
    thinking."""

    type: Literal["thinking_turns"]


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
