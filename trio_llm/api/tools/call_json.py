"""The scanner of one JSON tool-call object, ``{"name": ..., "arguments": ...}``, the
piece the ``--tool-call-parser`` formats share (`trio_llm.api.tools.parsers`)."""

from __future__ import annotations

import json
import re

from trio_llm.api.tools.calls import (
    CallDelta,
    ParsedDelta,
    ToolCallParser,
    decode_model_json,
    decode_name,
)

#: A call object's beginning up to the first character of its arguments value.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


class CallObject:
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
            name = decode_name(match.group(1)) if match is not None else None
            if match is not None and (name is None or not self.parser.accepts(name)):
                self._head, match = "x" * 4096, None  # no call's: decoded whole at its end
            if match is not None and name is not None:
                self._begin(name, out)
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
                value = decode_model_json(value)
            except ValueError:
                pass
        out.calls.append(CallDelta(self._index, value))

    def _decode_whole(self, out: ParsedDelta) -> None:
        try:
            call = decode_model_json(self.raw)
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
            try:
                arguments = json.dumps(arguments, ensure_ascii=False)
            except RecursionError:  # as deep as the decoder goes: no call
                self.failed = True
                return
        self._begin(call["name"], out)
        out.calls.append(CallDelta(self._index, arguments))


# ---------------------------------------------------------------- formats
