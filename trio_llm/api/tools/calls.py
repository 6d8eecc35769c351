"""Tool calls read out of a choice's text: the pieces a parser releases (`ParsedDelta`,
`CallDelta`) and the parser interface (`ToolCallParser`).

A parser is fed text as it is generated and returns `ParsedDelta`s: content text and tool
call pieces (a call's id and name first, then its arguments in pieces). The whole
response is the same parser fed the whole text, so a streamed and a non-streamed response
to the same output carry the same calls and content. The parsers of the
``--tool-call-parser`` formats are in `trio_llm.api.tools.parsers`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

#: A call object's beginning up to its whole name.
CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def new_call_id() -> str:
    """A tool call id as OpenAI writes them (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def decode_model_json(text: str) -> Any:
    """``json.loads`` of model output: JSON nested deeper than Python's parser goes
    (about 1,000 levels) is invalid JSON here, as a model steered into deep brackets
    must not end the request with a 500.

    Raises:
        ValueError: not valid JSON, or nested too deeply.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def decode_name(escaped: str) -> str | None:
    """A call name as the model wrote it between quotes (JSON escapes decoded), or None
    when its escapes are invalid (no call's name)."""
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:
        return None


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


class ToolCallParser(ABC):
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
        match = CALL_NAME.match(raw)
        name = decode_name(match.group(1)) if match is not None else None
        if name is not None and self.accepts(name):
            out.calls.append(self._start(name))

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of output text."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The text has ended: release whatever is held back."""

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
