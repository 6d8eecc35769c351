"""llguidance's grammar text for a `StructuredOutput` (`grammar_source`): a JSON
Schema, a JSON object, a regular expression, a choice list or a Lark grammar, optionally
after a reasoning prefix (`with_prefix`). The text is what both the API's check and the
engine's compile build a matcher from.
"""

from __future__ import annotations

import json

import msgspec

from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.errors import StructuredOutputError, one_line
from trio_llm.structured_output.schema_rewrites import without_vacuous_keywords
from trio_llm.structured_output.unsatisfiable import unsatisfiable_reason

#: JSON without optional whitespace (as ``json.dumps(separators=(",", ":"))`` writes it):
#: a model cannot spend its tokens on blank space between the fields.
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_source(spec: StructuredOutput) -> str:
    """llguidance's grammar text for ``spec`` (a JSON Schema also goes through
    `unsatisfiable_reason`); with a ``prefix``, the constraint's grammar follows the
    prefix's rule ``reasoning`` (`with_prefix`).

    Raises:
        StructuredOutputError: a malformed spec, or a schema that matches nothing.
    """
    from llguidance import LLMatcher

    if spec.prefix:
        return with_prefix(grammar_source(msgspec.structs.replace(spec, prefix="")), spec.prefix)
    try:
        if spec.kind == "json":
            schema = json.loads(spec.spec)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON Schema must be an object or a boolean")
            reason = unsatisfiable_reason(schema)
            if reason is not None:
                raise ValueError(reason)
            text = spec.spec
            if "propertyNames" in text:
                text = json.dumps(without_vacuous_keywords(schema))
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), JSON_DEFAULTS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            # The text of one choice, unquoted (as vLLM's choice): one lexeme of literals.
            # (Not a rule of them: llguidance's parser holds at most 2,000 items in a row,
            # and a rule of more alternatives fails at the output's first token.)
            alternatives = " | ".join(map(json.dumps, choices))
            return LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
        if spec.kind == "grammar":
            return LLMatcher.grammar_from_lark(spec.spec)
    except (ValueError, TypeError, RecursionError) as exc:
        raise StructuredOutputError(one_line(str(exc))) from exc
    raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def with_prefix(grammar: str, prefix: str) -> str:
    """llguidance's ``grammar`` (its JSON, or a Lark text) preceded by the Lark rule
    ``reasoning`` that ``prefix`` defines: a top-level Lark grammar
    ``start: reasoning @answer`` in front of the constraint's own grammars, the first of
    them named ``answer`` (llguidance's grammar references)."""
    try:
        top = json.loads(grammar)
    except ValueError:
        top = None
    if not isinstance(top, dict) or "grammars" not in top:  # a Lark grammar's text
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *others = top["grammars"]
    lark = f"start: reasoning @{_ANSWER}\n{prefix}"
    top["grammars"] = [{"lark_grammar": lark}, {**first, "name": _ANSWER}, *others]
    return json.dumps(top)


#: The name of a prefixed constraint's own grammar (`with_prefix`).
_ANSWER = "answer"
