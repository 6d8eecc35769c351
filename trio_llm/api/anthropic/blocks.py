"""The conversation of a Messages request (Anthropic's API): its turns (`Message`) and
their content blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``,
``redacted_thinking``). Field names and shapes follow Anthropic's API reference."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from trio_llm.api.chat.request_body import Text


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


class Message(BaseModel):
    """One turn: ``role`` user, assistant or system (a system message at that place of
    the conversation), ``content`` a string or content blocks."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: Text | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuse block types other than `_BLOCK_TYPES` (images, documents, server tool
        blocks, ...) by name, not as a union mismatch."""
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported: the model served "
                    f"here takes text only ({', '.join(_BLOCK_TYPES)} blocks)"
                )
        return data
