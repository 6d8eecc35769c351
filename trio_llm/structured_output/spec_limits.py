"""This server's size limits on a structured-output spec (`check_spec_limits`), checked
on the spec's text and JSON only, in time linear in its size, before any grammar work:
this module imports no grammar library.
"""

from __future__ import annotations

import json
from typing import Any

from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.errors import SpecLimitError

# Cheap limits on a spec (`check_spec_limits`). Each is well above what a sane client
# sends (OpenAI's Structured Outputs take at most 5,000 properties, 10 levels of nesting
# and 1,000 enum values per schema) and keeps the compile at its limit within a second
# or two on a 2-core machine (docs/structured-output.md has the figures).

#: Characters of a JSON Schema or of a choice list (as JSON text).
MAX_SCHEMA_CHARS = 256 * 1024
#: Characters of a regular expression or a Lark grammar (llguidance's lexer grows faster
#: than linearly with a grammar's distinct literals).
MAX_GRAMMAR_CHARS = 64 * 1024
#: Strings in one ``choice`` list (each becomes a lexeme; llguidance's grammar cannot
#: hold more than 65,535 symbols at all).
MAX_CHOICES = 4096
#: ``enum`` values in one JSON Schema, all ``enum`` lists together.
MAX_ENUM_VALUES = 4096
#: Nested objects and lists in one JSON Schema document (llguidance itself stops at 128).
MAX_SCHEMA_DEPTH = 64
#: Properties of one object schema (optional properties cost llguidance about
#: quadratically: 1,000 compile in about 0.3 s, 5,000 in 6 s).
MAX_OBJECT_PROPERTIES = 1000
#: Properties of all the object schemas of one JSON Schema (OpenAI's limit).
MAX_SCHEMA_PROPERTIES = 5000


def check_spec_limits(spec: StructuredOutput) -> None:
    """Refuse a spec over one of this server's limits, looking only at its text: sizes,
    counts and nesting (the ``MAX_*`` constants above). Linear in the spec's length and
    run before any grammar work, so an oversized spec is refused at once.

    Raises:
        SpecLimitError: the limit exceeded, by name and figure.
    """
    text = spec.spec
    if spec.kind in ("regex", "grammar"):
        what = "regular expression" if spec.kind == "regex" else "grammar"
        _check_size(text, MAX_GRAMMAR_CHARS, what)
    elif spec.kind == "choice":
        _check_size(text, MAX_SCHEMA_CHARS, "choice list")
        choices = _loads(text)
        if isinstance(choices, list) and len(choices) > MAX_CHOICES:
            raise SpecLimitError(
                f"{len(choices):,} choices is more than this server's limit of {MAX_CHOICES:,}"
            )
    elif spec.kind == "json":
        _check_size(text, MAX_SCHEMA_CHARS, "JSON Schema")
        _check_schema_counts(_loads(text))


def _check_size(text: str, limit: int, what: str) -> None:
    if len(text) > limit:
        raise SpecLimitError(
            f"the {what} has {len(text):,} characters, more than this server's limit of {limit:,}"
        )


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None  # malformed: the full check says so


def _check_schema_counts(schema: Any) -> None:
    """The nesting, property and enum counts of a JSON Schema document (a walk of every
    value with an explicit stack: no recursion, whatever the depth)."""
    properties = enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise SpecLimitError(
                f"the JSON Schema nests objects and lists more than {MAX_SCHEMA_DEPTH} deep "
                "(this server's limit)"
            )
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
            continue
        props = value.get("properties")
        if isinstance(props, dict):
            if len(props) > MAX_OBJECT_PROPERTIES:
                raise SpecLimitError(
                    f"an object schema has {len(props):,} properties, more than this "
                    f"server's limit of {MAX_OBJECT_PROPERTIES:,}"
                )
            properties += len(props)
            if properties > MAX_SCHEMA_PROPERTIES:
                raise SpecLimitError(
                    f"the JSON Schema has more than {MAX_SCHEMA_PROPERTIES:,} properties in "
                    "all (this server's limit)"
                )
        values = value.get("enum")
        if isinstance(values, list):
            enums += len(values)
            if enums > MAX_ENUM_VALUES:
                raise SpecLimitError(
                    f"the JSON Schema has more than {MAX_ENUM_VALUES:,} enum values in all "
                    "(this server's limit)"
                )
        stack.extend((item, depth + 1) for item in value.values())
