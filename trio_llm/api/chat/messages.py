"""The messages of a chat completion request (``messages``), as OpenAI's API reference
writes them: system, developer and user prompts, tool results, and earlier assistant turns
with their tool calls. Content is text only (a string or text parts); `template_message`
gives each as the chat template sees it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from trio_llm.api.chat.request_body import Text
from trio_llm.api.http.parsing import check_json_text_depth


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a chat message."""

    type: Literal["text"]
    text: Text


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuse content parts other than text (images, audio, files) by name: the
        models served take text only."""
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: the model "
                        "served here takes text only (send text parts or a string)"
                    )
        return data

    def text(self) -> str:
        """The content as one string."""
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)


class PromptMessage(_Message):
    """A system, developer or user message: ``content`` (a string or text parts)."""

    role: Literal["system", "developer", "user"]
    content: Text | list[TextContentPart]

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        return {"role": self.role, "content": self.text()}


class ToolMessage(_Message):
    """A tool's result (``role: "tool"``), answering the call ``tool_call_id``."""

    role: Literal["tool"]
    content: Text | list[TextContentPart]
    tool_call_id: Text

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        return {"role": "tool", "content": self.text(), "tool_call_id": self.tool_call_id}


class FunctionCall(BaseModel):
    """The function of an assistant's tool call; ``arguments`` is JSON text (nested at
    most `trio_llm.api.http.parsing.MAX_JSON_DEPTH` levels: the chat template walks it)."""

    name: Text
    arguments: Annotated[Text, AfterValidator(check_json_text_depth)]


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the response carried it."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    """An assistant message; ``content`` may be left out (OpenAI allows it here only),
    as it is when the turn made ``tool_calls``."""

    role: Literal["assistant"]
    content: Text | list[TextContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it: tool calls with their arguments
        decoded, as Hugging Face templates expect (left as text if not JSON)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _decoded(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # too deep: `FunctionCall` refuses it first
        return arguments


#: One chat message, told apart by ``role``.
ChatMessage = Annotated[PromptMessage | ToolMessage | AssistantMessage, Field(discriminator="role")]
