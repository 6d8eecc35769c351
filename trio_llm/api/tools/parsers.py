"""The ``--tool-call-parser`` formats: the parsers that read calls in the model's own
format out of a choice's text (each a `ToolCallParser`).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks among
  text (Hermes, Qwen and the template shipped for SmolLM2).
- ``llama3_json``: JSON objects ``{"name": ..., "parameters": ...}``, several separated
  by ``;`` (an optional ``<|python_tag|>`` first).

The output of a ``required`` tool_choice (`trio_llm.api.tools.grammar.tool_call_grammar`)
is read by `required_parser`, that of a named one by `NamedCallParser`.
"""

from __future__ import annotations

from trio_llm.api.tools.call_json import CallObject
from trio_llm.api.tools.calls import ParsedDelta, ToolCallParser
from trio_llm.config import TOOL_CALL_PARSERS


class _ContentMixin:
    """Content released around calls: whitespace next to a call is dropped (it is only
    layout), other text is kept as it came."""

    def _init_content(self) -> None:
        self._held_space = ""
        self._after_call = False

    def _content(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if not stripped:
            if not self._after_call:
                self._held_space += text
            return
        if self._after_call:
            stripped = stripped.lstrip()
            text = text.lstrip()
            self._after_call = False
        out.content += self._held_space + stripped
        self._held_space = text[len(stripped) :]

    def _call_boundary(self) -> None:
        self._held_space = ""
        self._after_call = True

    def _finish_content(self, out: ParsedDelta, has_calls: bool) -> None:
        if not has_calls:
            out.content += self._held_space
        self._held_space = ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesParser(ToolCallParser, _ContentMixin):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among text.

    A block whose inside is no call object is given back as content.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, *, names: frozenset[str] | None = None, held: bool = False) -> None:
        super().__init__(names=names, held=held)
        self._init_content()
        self._released = False  # whether any content went out
        self._state = "text"  # text, call, close
        self._pending = ""  # text: what may begin the open tag; close: what came so far
        self._call: CallObject | None = None

    def _feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self._state == "call":
                if self._call is None:
                    raise RuntimeError("a tool-call parser in a call without one")
                piece, text = self._call.take(text)
                out.extend(piece)
                if self._call.failed:
                    self._state = "text"
                    text = self._call.raw + text
                    self._content(self.OPEN, out)
                    self._call = None
                elif self._call.done:
                    self._state, self._pending, self._call = "close", "", None
            elif self._state == "close":
                seen = (self._pending + text).lstrip()
                text = ""
                if seen.startswith(self.CLOSE):
                    self._state, self._pending, text = "text", "", seen[len(self.CLOSE) :]
                elif self.CLOSE.startswith(seen):
                    self._pending = seen
                else:  # no close tag: what follows is text
                    self._state, self._pending, text = "text", "", seen
            else:
                text = self._pending + text
                self._pending = ""
                start = text.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(text, self.OPEN)
                    self._content(text[: len(text) - keep], out)
                    self._pending = text[len(text) - keep :]
                    return out
                self._content(text[:start], out)
                self._call_boundary()
                self._state, self._call = "call", CallObject(self)
                text = text[start + len(self.OPEN) :]
        return out

    def feed(self, text: str) -> ParsedDelta:
        out = self._feed(text)
        self._released = self._released or bool(out.content)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "call" and self._call is not None and not self._call.started:
            if self.held:
                self._truncated(self._call.raw, out)
            else:
                self._content(self.OPEN + self._call.raw, out)
        elif self._state != "call":
            # Held: a close tag's beginning, or an open tag's where no answer began, is
            # what a cut-off call left.
            if not (self.held and (self._state == "close" or not self._released)):
                self._content(self._pending, out)
        self._state, self._pending, self._call = "text", "", None
        self._finish_content(out, self.num_calls > 0)
        return out


class JsonCallsParser(ToolCallParser, _ContentMixin):
    """Call objects one after another: ``llama3_json`` (an optional ``<|python_tag|>``,
    calls separated by ``;``) or the array of a ``required`` tool_choice
    (``[call,call]``).

    An output that does not begin with a call object is content; so is an output whose
    first object is no call, and whatever follows the calls.
    """

    def __init__(
        self,
        *,
        prefix: str = "",
        separators: str = ";",
        names: frozenset[str] | None = None,
        held: bool = False,
    ) -> None:
        super().__init__(names=names, held=held)
        self._init_content()
        self.prefix = prefix
        self.separators = separators
        self._state = "start"  # start, calls, text
        self._seen = ""  # all text, until the first call begins
        self._call: CallObject | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.num_calls == 0:
            self._seen += text
        while text:
            if self._state == "text":
                self._content(text, out)
                return out
            if self._state == "start":
                head = self._seen.lstrip()
                if self.prefix and self.prefix.startswith(head):
                    return out  # may still become the prefix
                if self.prefix and head.startswith(self.prefix):
                    head = head[len(self.prefix) :]
                head = head.lstrip(self.separators + " \t\r\n")
                if not head:
                    return out
                if head[0] != "{":
                    self._state = "text"
                    text = self._seen
                    continue
                self._state, text = "calls", head
            if self._call is None:
                text = text.lstrip(self.separators + " \t\r\n")
                if not text:
                    return out
                if text[0] != "{":
                    self._state = "text"
                    continue
                self._call = CallObject(self)
            piece, text = self._call.take(text)
            out.extend(piece)
            if self._call.failed:
                raw, self._call, self._state = self._call.raw, None, "text"
                text = self._seen if self.num_calls == 0 else raw + text
            elif self._call.done:
                self._call = None
                self._call_boundary()
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        unstarted = self._call is not None and not self._call.started
        if self.held and (unstarted or self._state == "start"):
            if self._call is not None:
                self._truncated(self._call.raw, out)
        elif self._state == "start" or (unstarted and self.num_calls == 0):
            self._content(self._seen, out)
        elif unstarted and self._call is not None:
            self._content(self._call.raw, out)
        self._state, self._call = "text", None
        self._finish_content(out, self.num_calls > 0)
        return out


def required_parser() -> ToolCallParser:
    """The parser of a ``required`` tool_choice's output (`tool_call_grammar`): the
    output is known to be calls, so a call cut off by ``max_tokens`` is no content."""
    return JsonCallsParser(separators=",[]", held=True)


def make_parser(
    name: str, *, names: frozenset[str] | None = None, held: bool = False
) -> ToolCallParser:
    """A fresh parser of the ``--tool-call-parser`` called ``name``; ``names`` and
    ``held`` as `ToolCallParser`'s (``tool_choice: "auto"`` with a response format:
    `calls_or_answer_grammar` held the output).

    Raises:
        ValueError: an unknown name.
    """
    if name == "hermes":
        return HermesParser(names=names, held=held)
    if name == "llama3_json":
        return JsonCallsParser(prefix="<|python_tag|>", separators=";", names=names, held=held)
    raise ValueError(f"unknown tool call parser {name!r}; known: {list(TOOL_CALL_PARSERS)}")
