"""The output constraints of tool calling on ``/v1/chat/completions``: the grammar that
forces a call, and the one that allows calls or an answer held to a response format.

How a request's ``tool_choice`` is served (vLLM's behaviour):

- ``"none"``: tools are shown to the model (through the chat template) and the output is
  plain text.
- a named function: the output is constrained to a JSON object valid against that
  function's ``parameters`` schema; it is that call's ``arguments``.
- ``"required"``: the output is constrained to a JSON array of one or more calls,
  ``[{"name":...,"arguments":{...}},...]`` (one call when ``parallel_tool_calls`` is
  false), each valid against its function's schema.
- ``"auto"``: the output is free; the server's tool-call parser
  (``--tool-call-parser``, `trio_llm.api.tools.parsers`) reads calls in the model's own
  format out of it. With a response format, the output is held to
  `calls_or_answer_grammar`: calls in that format, or the answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trio_llm.messages import StructuredOutput

#: The JSON Schema of a function without ``parameters`` (OpenAI: no arguments).
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance told to allow no optional whitespace (as
    `trio_llm.structured_output.grammar.JSON_DEFAULTS` does for a whole-output schema)."""
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
