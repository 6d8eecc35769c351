"""The prompt layer's inputs and outputs (`trio_llm.frontend.preprocess.InputPreprocessor`
works on them): what the chat template renders into one prompt (`ChatPrompt`, and
`fold_system_messages` for templates that cannot show a system message after the first
message), what a chat request asks of its choices (`ChatChoices`), a tokenized `Prompt`,
its `OutputBudget`, and a chat request's engine requests (`PreparedChat`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trio_llm.messages import SamplingParams


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


#: What ends an output that reaches its budget (`OutputBudget.bound`): the request's own
#: ``max_tokens``, the server's (its generation config's ``max_new_tokens``: the default of
#: a request without one, or the cap of ``--override-generation-config``), or the room
#: the prompt leaves in the context.
OUTPUT_BOUNDS = ("request", "server", "context")


@dataclass(frozen=True)
class OutputBudget:
    """One prompt's output budget.

    Attributes:
        tokens: the most output tokens (the engine request's ``max_tokens``).
        bound: which limit set it (`OUTPUT_BOUNDS`; the context where several are equal,
            then the request's own): an answer that ends at ``tokens`` was cut by it.
    """

    tokens: int
    bound: str


@dataclass
class Prompt:
    """One tokenized prompt.

    Attributes:
        token_ids: what the engine is given.
        text: the text it came from (a completion's as given, for ``echo``; a chat's as
            rendered), or None for a prompt given as token ids.
    """

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class ChatChoices:
    """What a chat request asks of its choices (`InputPreprocessor.prepare_chat`).

    Attributes:
        n: samples of the prompt (each its own engine request).
        sampling: the `SamplingParams` of one sample given its ``max_tokens`` (the budget
            the context leaves; 1 when only counted); `fan_out` seeds the others.
        max_tokens: the request's own limit, or None.
        max_tokens_param: the field that set it (errors name it).
        default_max_tokens: the server's default for a request without one, or None.
        max_tokens_cap: the server's cap on every output, or None.
        stop_token_ids: the request's ``stop_token_ids`` (checked against the vocabulary).
        count_only: only the prompt is wanted (``/v1/messages/count_tokens``): any length
            is counted, nothing refused for the context.
    """

    n: int
    sampling: Callable[[int], SamplingParams]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int | None = None
    max_tokens_cap: int | None = None
    stop_token_ids: list[int] | None = None
    count_only: bool = False


@dataclass(frozen=True)
class PreparedChat:
    """A chat request's engine requests (`InputPreprocessor.prepare_chat`).

    Attributes:
        prompt: the tokenized prompt, with its rendered text.
        budget: its output budget and what set it.
        requests: ``(prompt_token_ids, params)`` per choice, in choice order.
    """

    prompt: Prompt
    budget: OutputBudget
    requests: list[tuple[list[int], SamplingParams]]
