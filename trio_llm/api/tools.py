"""Tool calling on ``/v1/chat/completions``: the grammar that forces a call, and the
parsers that read calls out of a choice's text.

How a request's ``tool_choice`` is served (vLLM's behaviour):

- ``"none"``: tools are shown to the model (through the chat template) and the output is
  plain text.
- a named function: the output is constrained to a JSON object valid against that
  function's ``parameters`` schema; it is that call's ``arguments``.
- ``"required"``: the output is constrained to a JSON array of one or more calls,
  ``[{"name":...,"arguments":{...}},...]`` (one call when ``parallel_tool_calls`` is
  false), each valid against its function's schema.
- ``"auto"``: the output is free; the server's tool-call parser
  (``--tool-call-parser``) reads calls in the model's own format out of it: ``hermes``
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Hermes, Qwen and the
  template shipped for SmolLM2) or ``llama3_json`` (a JSON object
  ``{"name": ..., "parameters": ...}``, several separated by ``;``).

A parser is fed text as it is generated and returns `ParsedDelta`s: content text and tool
call pieces (a call's id and name first, then its arguments in pieces). The whole
response is the same parser fed the whole text, so a streamed and a non-streamed response
to the same output carry the same calls and content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from trio_llm.config import TOOL_CALL_PARSERS
from trio_llm.messages import StructuredOutput

#: The JSON Schema of a function without ``parameters`` (OpenAI: no arguments).
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def new_call_id() -> str:
    """A tool call id as OpenAI writes them (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance told to allow no optional whitespace (as
    `trio_llm.engine.structured.JSON_DEFAULTS` does for a whole-output schema)."""
    options = dict(schema.get("x-guidance") or {})
    options.setdefault("whitespace_flexible", False)
    return {**schema, "x-guidance": options}


def tool_call_grammar(
    functions: dict[str, dict[str, Any]], name: str | None, parallel_tool_calls: bool
) -> StructuredOutput:
    """The output constraint of a forced tool call.

    Args:
        functions: each tool's name and its ``parameters`` JSON Schema.
        name: the function a named tool_choice forces; None for ``"required"``.
        parallel_tool_calls: whether ``required`` may produce more than one call.

    Returns:
        For a named function, a ``json`` constraint (the arguments object); for
        ``required``, a Lark ``grammar`` of a JSON array of calls.
    """
    if name is not None:
        return StructuredOutput("json", json.dumps(functions[name]))
    calls = 'call ("," call)*' if parallel_tool_calls else "call"
    rules = _call_rules(functions, '{{"name":{name},"arguments":')
    return StructuredOutput("grammar", "\n".join([f'start: "[" {calls} "]"', *rules]))


#: A JSON lexeme of a call object's head: a string, a run of blanks, or one character.
_JSON_LEXEME = re.compile(r'"(?:[^"\\]|\\.)*"|\s+|.')


def _call_rules(functions: dict[str, dict[str, Any]], head: str) -> list[str]:
    """Lark rules of one call object, ``call``: one alternative per function, its
    ``head`` (a format string of ``name``, the function's name as JSON), then its
    arguments held to its schema (compact JSON), then ``}``."""
    alternatives = []
    rules = []
    for i, (name, schema) in enumerate(functions.items()):
        # One literal per JSON lexeme (brace, string, colon, comma, blank): beside an
        # answer that is a JSON object, a literal spanning lexemes would be taken
        # greedily by llguidance's lexer and leave no way to the answer's own keys.
        pieces = _JSON_LEXEME.findall(head.format(name=json.dumps(name)))
        text = " ".join(map(json.dumps, pieces))
        rules.append(f'call_{i}: {text} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(compact_schema(schema))}")
        alternatives.append(f"call_{i}")
    return ["call: " + " | ".join(alternatives), *rules]


#: How each ``--tool-call-parser`` format writes calls in `calls_or_answer_grammar`:
#: (what opens a call, the call object's head, what closes it, between two calls).
_CALL_SYNTAX = {
    "hermes": ("<tool_call>\n", '{{"name": {name}, "arguments": ', "\n</tool_call>", "\n"),
    "llama3_json": ("", '{{"name": {name}, "parameters": ', "", "; "),
}


def calls_or_answer_grammar(
    functions: dict[str, dict[str, Any]],
    answer: StructuredOutput,
    parser: str,
    parallel_tool_calls: bool,
) -> StructuredOutput:
    """The output constraint of ``tool_choice: "auto"`` with a response format: either
    tool calls, written as the server's tool-call ``parser`` reads them (hermes:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, one per
    line; llama3_json: ``{"name": ..., "parameters": {...}}`` objects separated by
    ``; ``), each call's arguments held to its function's schema; or an answer held to
    the format. One Lark grammar of two alternatives (``start: calls | answer``).

    Args:
        functions: each tool's name and its ``parameters`` JSON Schema.
        answer: the format: a ``json`` (JSON Schema) or ``json_object`` constraint.
        parser: a name of `TOOL_CALL_PARSERS`.
        parallel_tool_calls: whether the output may hold more than one call.

    Raises:
        ValueError: ``answer`` is of another kind, or ``parser`` is unknown.
    """
    if parser not in _CALL_SYNTAX:
        raise ValueError(f"unknown tool call parser {parser!r}; known: {list(_CALL_SYNTAX)}")
    if answer.kind == "json_object":
        schema: Any = {"type": "object"}
    elif answer.kind == "json":
        schema = json.loads(answer.spec)
    else:
        raise ValueError(f"a {answer.kind!r} constraint cannot be combined with tools")
    opener, head, closer, between = _CALL_SYNTAX[parser]
    block = " ".join(
        [
            *([json.dumps(opener)] if opener else []),
            "call",
            *([json.dumps(closer)] if closer else []),
        ]
    )
    calls = f"block ({json.dumps(between)} block)*" if parallel_tool_calls else "block"
    lines = [
        "start: calls | answer" if schema is not False else "start: calls",
        f"calls: {calls}",
        f"block: {block}",
        *_call_rules(functions, head),
    ]
    if schema is not False:
        schema = {} if schema is True else schema
        lines.append(f"answer: %json {json.dumps(compact_schema(schema))}")
    return StructuredOutput("grammar", "\n".join(lines))


# ---------------------------------------------------------------- parsed output


@dataclass
class CallDelta:
    """A piece of one tool call: ``id`` and ``name`` on its first piece only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The piece as an entry of a chunk's ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedDelta:
    """What a parser released: content text and tool-call pieces (in call order)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        """Append ``other``, merging argument pieces of the same call."""
        self.content += other.content
        for piece in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == piece.index and piece.id is None:
                last.arguments += piece.arguments
            else:
                self.calls.append(CallDelta(piece.index, piece.arguments, piece.id, piece.name))

    def tool_calls(self) -> list[dict[str, Any]]:
        """Whole calls (of a whole text), as a message's ``tool_calls``."""
        return [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in _merged(self.calls)
        ]


def _merged(pieces: list[CallDelta]) -> list[CallDelta]:
    calls: dict[int, CallDelta] = {}
    for piece in pieces:
        if piece.index in calls:
            calls[piece.index].arguments += piece.arguments
        else:
            calls[piece.index] = CallDelta(piece.index, piece.arguments, piece.id, piece.name)
    return list(calls.values())


class ToolCallParser:
    """Reads tool calls out of one choice's text (base class).

    `feed` takes each new piece of text, `finish` ends the text; both return what can be
    released. ``num_calls`` counts the calls begun so far.

    Args:
        names: the function names a call may have; an object naming another is no call
            (it is text). None: any name.
        held: the output was held to a grammar of calls (a forced tool_choice, or tools
            with a response format): a call the text began is a call, even when the text
            ends inside it (``max_tokens``). At the end, one cut off after its name is
            reported with the arguments it has (possibly none), one cut off before is
            dropped; neither is ever given back as content.
    """

    def __init__(self, *, names: frozenset[str] | None = None, held: bool = False) -> None:
        self.num_calls = 0
        self.names = names
        self.held = held

    def accepts(self, name: str) -> bool:
        """Whether a call may name the function ``name``."""
        return self.names is None or name in self.names

    def _truncated(self, raw: str, out: ParsedDelta) -> None:
        """A held call cut off before its arguments began (``raw``, its text so far):
        report it with no arguments if its name is whole, else drop it."""
        match = _NAME.match(raw)
        if match is not None:
            name = json.loads(f'"{match.group(1)}"')
            if self.accepts(name):
                out.calls.append(self._start(name))

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of output text."""
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """The text has ended: release whatever is held back."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedDelta:
        """A whole text at once (`feed` then `finish`)."""
        result = self.feed(text)
        result.extend(self.finish())
        return result

    def _start(self, name: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, "", new_call_id(), name)


class NamedCallParser(ToolCallParser):
    """The output of a named ``tool_choice``: the whole text is that call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        calls = [] if self.num_calls else [self._start(self.name)]
        if text:
            calls.append(CallDelta(0, text))
        return ParsedDelta("", calls)

    def finish(self) -> ParsedDelta:
        return self.feed("")


# ---------------------------------------------------------------- one call object

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
#: A call object's beginning up to its whole name.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class _CallObject:
    """Scans the text of one JSON call object ``{"name": ..., "arguments": ...}``.

    While the name and the start of the arguments are recognised (the usual key order) the
    arguments are released as they arrive; otherwise the object is kept until it closes,
    then decoded whole. ``failed``: the text is no call object (give it back as content).
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self._raw: list[str] = []  # every character taken (joined on demand: `raw`)
        self.done = False
        self.failed = False
        self.started = False
        self._phase = "head"  # head: before the arguments value; value; tail: after it
        self._head = ""
        self._value = ""
        self._kind = ""  # the value's first character: "{", "[", '"', or "" for a scalar
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._index = -1

    @property
    def raw(self) -> str:
        """Every character taken so far."""
        return "".join(self._raw)

    def take(self, text: str) -> tuple[ParsedDelta, str]:
        """Scan ``text``; return the release and the text after the object's end."""
        out = ParsedDelta()
        for position, char in enumerate(text):
            if self.done:
                return out, text[position:]
            self._take_char(char, out)
        return out, ""

    def _take_char(self, char: str, out: ParsedDelta) -> None:
        self._raw.append(char)
        if self._depth == 0 and not self._in_string:
            if char.isspace():
                return
            if char != "{":
                self.failed = self.done = True
                return
        scalar = self._phase == "value" and not self._kind
        if scalar and not self._in_string and self._depth == 1 and char in ",}":
            self._end_value(out)
        closed_bracket = closed_string = False
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                closed_string = True
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            closed_bracket = True
        if self._phase == "value":
            if self._kind not in ("{", "["):  # an object or array is released as it comes
                self._value += char
            if self._kind in ("{", "["):
                out.calls.append(CallDelta(self._index, char))
                if closed_bracket and self._depth == 1:
                    self._phase = "tail"
            elif self._kind == '"' and closed_string and self._depth == 1:
                self._end_value(out)
        elif self._phase == "head":
            match = None
            if len(self._head) < 4096:  # past that, the object is decoded whole at its end
                self._head += char
                match = _HEAD.match(self._head)
            if match is not None and not self.parser.accepts(json.loads(f'"{match.group(1)}"')):
                self._head, match = "x" * 4096, None  # no call's: decoded whole at its end
            if match is not None:
                self._begin(json.loads(f'"{match.group(1)}"'), out)
                self._phase = "value"
                self._value = char
                self._kind = char if char in '{["' else ""
                if self._kind in ("{", "["):
                    out.calls.append(CallDelta(self._index, char))
        if closed_bracket and self._depth == 0:
            self.done = True
            if not self.started:
                self._decode_whole(out)
            elif self._phase == "value":
                self._end_value(out)

    def _begin(self, name: str, out: ParsedDelta) -> None:
        self.started = True
        start = self.parser._start(name)
        self._index = start.index
        out.calls.append(start)

    def _end_value(self, out: ParsedDelta) -> None:
        """A string or scalar arguments value has ended: release it whole."""
        self._phase = "tail"
        value = self._value.strip()
        if self._kind == '"':
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out.calls.append(CallDelta(self._index, value))

    def _decode_whole(self, out: ParsedDelta) -> None:
        try:
            call = json.loads(self.raw)
        except ValueError:
            call = None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not self.parser.accepts(call["name"])
        ):
            self.failed = True
            return
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        self._begin(call["name"], out)
        out.calls.append(CallDelta(self._index, arguments))


# ---------------------------------------------------------------- formats


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
        self._call: _CallObject | None = None

    def _feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self._state == "call":
                assert self._call is not None
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
                self._state, self._call = "call", _CallObject(self)
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
        self._call: _CallObject | None = None

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
                self._call = _CallObject(self)
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
        elif unstarted:
            assert self._call is not None
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
