"""What the chat template renders into one prompt: `ChatPrompt`, and
`fold_system_messages` for templates that cannot show a system message after the first
message (`trio_llm.frontend.preprocess.InputPreprocessor` renders both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestTemplate:
    """A chat template that came with a request (``chat_template``), allowed by
    ``--trust-request-chat-template``.

    Attributes:
        source: the template's text (within ``--max-request-chat-template-bytes``).
        timeout: seconds its rendering may take (``--request-chat-template-timeout``).
    """

    source: str
    timeout: float


@dataclass
class ChatPrompt:
    """What the chat template renders into one prompt (`Tokenizer.render_chat`).

    Attributes:
        messages: the conversation, as template dicts (``role``, ``content``, ...).
        tools: the tools shown to the model (OpenAI function specs), or None.
        continue_final_message: leave the last (assistant) message open to continue.
        template_kwargs: further template variables (``chat_template_kwargs``), or None.
        fold_late_system: fold system messages after the first into the leading system
            prompt when the template cannot show them at their place.
        add_generation_prompt: end with the assistant's prompt.
        request_template: the request's own template, rendered instead of the model's
            (in a worker thread, within its caps), or None.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None
    fold_late_system: bool = False
    add_generation_prompt: bool = True
    request_template: RequestTemplate | None = None

    def size(self) -> int:
        """Characters of its messages, tools and template variables (what the template's
        cost grows with)."""
        size = sum(len(m["content"]) for m in self.messages)
        size += len(json.dumps(self.tools)) if self.tools else 0
        return size + (len(json.dumps(self.template_kwargs)) if self.template_kwargs else 0)


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every system message after the first message moved into the
    leading system prompt (one is added when the conversation has none): their texts
    appended to it in order, each after a blank line. The other messages keep their order.
    """
    late = [m for m in messages[1:] if m.get("role") == "system"]
    if not late:
        return messages
    rest = [m for m in messages[1:] if m.get("role") != "system"]
    texts = [m.get("content") or "" for m in late]
    if messages[0].get("role") == "system":
        texts.insert(0, messages[0].get("content") or "")
    else:
        rest.insert(0, messages[0])
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest]
