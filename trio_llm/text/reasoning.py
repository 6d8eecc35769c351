"""Reasoning models: the model's reasoning (``<think>...</think>``) read apart from its
answer (``--reasoning-parser``, vLLM's flag and parser names).

A reasoning model writes its chain of thought first, between ``<think>`` and
``</think>``, then its answer. How each parser reads an output (as vLLM's):

- ``deepseek_r1`` (DeepSeek-R1 and its distillations, QwQ): the output begins inside the
  reasoning, as the chat templates of these models write the opening ``<think>`` into
  the prompt (or the model writes it: it is dropped). Everything before the first
  ``</think>`` is reasoning, everything after it the answer (``content``). An output
  without ``</think>`` is all reasoning: it was cut off while reasoning (``content`` is
  null).
- ``qwen3`` (Qwen3's hybrid thinking): the reasoning is what the model writes between a
  ``<think>`` that opens its output and ``</think>``; an output that does not open with
  ``<think>`` is all answer. With ``chat_template_kwargs: {"enable_thinking": false}``
  (Qwen3's template then writes an empty ``<think></think>`` into the prompt) there is no
  reasoning. A ``<think>`` never closed: the rest is reasoning (cut off while reasoning),
  as vLLM's current qwen3 parser reads it.

For both, the prompt can say where the output begins (`reasoning_format`): a prompt
that ends with ``<think>`` (a template that opens the reasoning for the model, as
Qwen3's thinking-only templates do) starts inside the reasoning, and one that ends with
``</think>`` (the reasoning already closed, as Qwen3's template does with
``enable_thinking`` false) starts in the answer.

A `ReasoningParser` is fed text as it is generated and returns `ReasoningDelta`\\ s
(reasoning and content pieces), holding back only what may be the beginning of a tag
split across pieces. The whole response is the same parser fed the whole text, so a
streamed and a non-streamed response to the same output carry the same reasoning and
content. The content then goes on to the tool-call parser, if any
(`trio_llm.api.chat.format`).

Output constraints apply after the reasoning (vLLM's behaviour): `ReasoningFormat.grammar`
gives the Lark rules (llguidance's dialect) of the reasoning part, which the engine puts
before the constraint (`trio_llm.messages.StructuredOutput.prefix`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from trio_llm.config import REASONING_PARSERS

#: The tags of both parsers.
START_TAG = "<think>"
END_TAG = "</think>"

#: Where an output begins: inside the reasoning; maybe opening it (with the start tag,
#: else in the answer); in the answer (no reasoning at all).
Start = Literal["reasoning", "maybe", "content"]


@dataclass
class ReasoningDelta:
    """What a reasoning parser released: reasoning text, then content (answer) text."""

    reasoning: str = ""
    content: str = ""

    def extend(self, other: ReasoningDelta) -> None:
        """Append ``other``."""
        self.reasoning += other.reasoning
        self.content += other.content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (and is shorter)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Reads one choice's text into reasoning and content (see the module doc).

    `feed` takes each new piece of text and `finish` ends the text; both return what
    can be released. Text that may begin a tag is held back until the next piece says.

    Args:
        start: where the output begins (`Start`).
        start_tag: the tag that opens the reasoning (dropped wherever the model writes it
            while reasoning).
        end_tag: the tag that ends it.
    """

    def __init__(self, start: Start, *, start_tag: str = START_TAG, end_tag: str = END_TAG) -> None:
        self.state: Start = start
        self.start_tag = start_tag
        self.end_tag = end_tag
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning."""
        return self.state == "reasoning"

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of output text."""
        out = ReasoningDelta()
        text = self._held + text
        self._held = ""
        if self.state == "maybe":
            head = text.lstrip()
            if head.startswith(self.start_tag):
                self.state = "reasoning"
                text = head[len(self.start_tag) :]
            elif self.start_tag.startswith(head):
                self._held = text  # blank space, or the start tag's beginning
                return out
            else:
                self.state = "content"
        if self.state == "content":
            out.content = text
            return out
        while True:
            end = text.find(self.end_tag)
            start = text.find(self.start_tag)
            if end >= 0 and (start < 0 or end < start):
                out.reasoning += text[:end]
                out.content = text[end + len(self.end_tag) :]
                self.state = "content"
                return out
            if start < 0:
                break
            out.reasoning += text[:start]  # a start tag inside the reasoning is dropped
            text = text[start + len(self.start_tag) :]
        keep = max(_partial_suffix(text, self.end_tag), _partial_suffix(text, self.start_tag))
        out.reasoning += text[: len(text) - keep]
        self._held = text[len(text) - keep :]
        return out

    def finish(self) -> ReasoningDelta:
        """The text has ended: release what is held back (the beginning of a tag that
        never completed is text, in the part it was found in)."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)

    def parse(self, text: str) -> ReasoningDelta:
        """A whole text at once (`feed` then `finish`)."""
        result = self.feed(text)
        result.extend(self.finish())
        return result


@dataclass(frozen=True)
class ReasoningFormat:
    """How one request's output is read: its parser and where its output begins.

    Attributes:
        name: the ``--reasoning-parser``.
        start: where the output begins (`Start`).
        start_tag, end_tag: the reasoning's tags.
    """

    name: str
    start: Start
    start_tag: str = START_TAG
    end_tag: str = END_TAG

    def parser(self) -> ReasoningParser:
        """A fresh parser for one choice."""
        return ReasoningParser(self.start, start_tag=self.start_tag, end_tag=self.end_tag)

    def grammar(self, token_id: Callable[[str], int | None]) -> str | None:
        """The Lark rules (llguidance's dialect) of the reasoning part that comes before
        an output constraint: they define the rule ``reasoning``, free text up to the
        end tag; None when the output has no reasoning (the constraint applies from its
        first token).

        Args:
            token_id: the id of a tag that is a token of its own (an added token, as
                ``<think>`` and ``</think>`` are in Qwen3's and DeepSeek-R1's
                vocabularies), else None (the tag is text: the model spells it out).
        """
        if self.start == "content":
            return None
        start, end = token_id(self.start_tag), token_id(self.end_tag)
        if end is not None:
            # Free text that never spells the end tag out, then the end tag's token.
            text = _lark_text(self.end_tag)
            open_tag = f"<[{start}]>" if start is not None else _lark_string(self.start_tag)
            body = f"REASONING_TEXT <[{end}]>"
            rules = [f"REASONING_TEXT: /(?s:.*)/ & ~/(?s:.*){text}(?s:.*)/"]
        else:
            # The shortest text that ends with the end tag (a lazy lexeme).
            open_tag = _lark_string(self.start_tag)
            body = "reasoning_text"
            rules = [f"reasoning_text[lazy]: /(?s:.*){_lark_text(self.end_tag)}/"]
        if self.start == "reasoning":
            head = f"reasoning: {open_tag}? {body}"
        else:  # maybe: the output opens the reasoning or goes straight to the answer
            head = f"reasoning: ({open_tag} {body})?"
        return "\n".join([head, *rules])


#: Characters escaped in a Lark ``/regex/`` (its delimiter and the regex metacharacters;
#: not ``<`` or ``>``: escaped, they are word boundaries).
_REGEX_SPECIAL = set("/\\.^$*+?()[]{}|-")


def _lark_text(tag: str) -> str:
    """``tag`` as literal text inside a Lark ``/regex/``."""
    return "".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in tag)


def _lark_string(tag: str) -> str:
    """``tag`` as a Lark string literal."""
    return '"' + tag.replace("\\", "\\\\").replace('"', '\\"') + '"'


def thinking_switch(chat_template_kwargs: Mapping[str, Any] | None) -> bool | None:
    """The ``enable_thinking`` a request gives its chat template, if it is a bool."""
    value = (chat_template_kwargs or {}).get("enable_thinking")
    return value if isinstance(value, bool) else None


def reasoning_format(
    name: str, prompt: str, chat_template_kwargs: Mapping[str, Any] | None = None
) -> ReasoningFormat:
    """How the output that follows ``prompt`` (the rendered chat prompt) is read by the
    ``--reasoning-parser`` called ``name`` (see the module doc).

    Raises:
        ValueError: an unknown name.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {list(REASONING_PARSERS)}")
    tail = prompt.rstrip()
    start: Start
    if name == "qwen3" and thinking_switch(chat_template_kwargs) is False:
        start = "content"
    elif tail.endswith(END_TAG):
        start = "content"  # the template closed an empty reasoning: the answer follows
    elif tail.endswith(START_TAG):
        start = "reasoning"  # the template opened the reasoning for the model
    else:
        start = "reasoning" if name == "deepseek_r1" else "maybe"
    return ReasoningFormat(name, start)
