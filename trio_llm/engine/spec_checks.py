"""Cheap checks of a structured-output spec, before any grammar work: this server's size
limits (`check_spec_limits`) and JSON Schemas that no finite value matches
(`unsatisfiable_reason`). Both look at the spec's text and JSON only, in time linear in its
size (the second, a few passes over the ``$ref`` targets), and import no grammar library.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from trio_llm.messages import StructuredOutput

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


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be enforced; the message says why (one line
    of text, without the grammar library's state dumps or backtraces)."""


class SpecLimitError(StructuredOutputError):
    """A spec over one of this server's size limits (`check_spec_limits`)."""


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


# ---------------------------------------------------------------- schemas that match nothing

#: Keywords whose value is one subschema, a list of them, or a map of names to them
#: (the values of ``enum``, ``const``, ``default`` and ``examples`` are data, not schemas;
#: ``$defs`` and ``definitions`` are reached through ``$ref`` only).
_ONE_SCHEMA = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")


def unsatisfiable_reason(schema: Any) -> str | None:
    """Why no finite JSON value matches ``schema`` or one of the subschemas an output
    could enter (a ``$ref`` target that requires itself without end), else None.

    Such a subschema is not a mistake llguidance reports: it compiles into a rule that a
    model can start and never finish (``{"$ref": "#"}``, or an object whose required
    property is the object itself). The test is the classic one for grammars: a schema
    is *productive* when some finite value matches it. Productivity is computed twice
    over the ``$ref`` targets reachable from the root: as the least fixed point (a target
    is productive only if shown so from productive targets) and the greatest (cycles are
    assumed productive). A target productive only in the greatest one is empty because
    of its cycles alone: that is refused. Emptiness for other reasons (``false``, an
    empty ``enum``, ``minimum`` above ``maximum``) is left to llguidance, which reports
    it itself (or leaves such a property out). Anything not understood here counts as
    productive, so this never refuses a schema some value matches.
    """
    root = schema
    targets = {id(root): ("#", root)}
    worklist = [root]
    while worklist:  # the $ref targets reachable from the root
        for ref in _refs(worklist.pop()):
            node = _resolve(root, ref)
            if node is not None and id(node) not in targets:
                targets[id(node)] = (ref, node)
                worklist.append(node)

    least: set[int] = set()
    changed = True
    while changed:
        changed = False
        for key, (_, node) in targets.items():
            if key not in least and _productive(node, root, least.__contains__):
                least.add(key)
                changed = True
    greatest = set(targets)
    changed = True
    while changed:
        changed = False
        for key, (_, node) in targets.items():
            if key in greatest and not _productive(node, root, greatest.__contains__):
                greatest.discard(key)
                changed = True
    for key, (ref, _) in targets.items():
        if key in greatest and key not in least:
            where = "the schema" if ref == "#" else f"the subschema {ref}"
            return (
                f"{where} matches no JSON value: it requires itself through $ref without "
                "end, so every value would be infinitely deep"
            )
    return None


def _subschemas(node: dict[str, Any]) -> Iterator[Any]:
    """The subschemas of ``node`` (one level), as `_ONE_SCHEMA`, `_SCHEMA_LISTS` and
    `_SCHEMA_MAPS` name them."""
    for name in _ONE_SCHEMA:
        value = node.get(name)
        if isinstance(value, dict):
            yield value
    for name in _SCHEMA_LISTS:
        value = node.get(name)
        if isinstance(value, list):
            yield from value
    for name in _SCHEMA_MAPS:
        value = node.get(name)
        if isinstance(value, dict):
            yield from value.values()


def _refs(node: Any) -> Iterator[str]:
    """The ``$ref`` strings in ``node`` and its subschemas, not through other refs."""
    stack = [node]
    while stack:
        value = stack.pop()
        if not isinstance(value, dict):
            continue
        ref = value.get("$ref")
        if isinstance(ref, str):
            yield ref
        stack.extend(_subschemas(value))


def _resolve(root: Any, ref: str) -> Any:
    """The node a local ``$ref`` (``#`` or ``#/json/pointer``) names in ``root``; None for
    other references (remote, or by ``$id``) and for pointers into nothing."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None


def _productive(node: Any, root: Any, productive_target: Callable[[int], bool]) -> bool:
    """Whether some finite value matches ``node``, given which ``$ref`` targets are
    productive; True where unsure. Recursion follows the schema document only (its
    depth is at most `MAX_SCHEMA_DEPTH`), never a reference."""
    if not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is not None and not productive_target(id(target)):
            return False
    parts = node.get("allOf")
    if isinstance(parts, list) and not all(_productive(p, root, productive_target) for p in parts):
        return False
    for name in ("anyOf", "oneOf"):
        options = node.get(name)
        if (
            isinstance(options, list)
            and options
            and not any(_productive(o, root, productive_target) for o in options)
        ):
            return False
    if "enum" in node or "const" in node:
        return True  # literal values (whatever else constrains them is llguidance's)
    types = node.get("type")
    if types is None:
        return True  # any JSON type; a number matches whatever object keywords say
    for kind in [types] if isinstance(types, str) else types if isinstance(types, list) else []:
        if kind == "object" and not _object_productive(node, root, productive_target):
            continue
        if kind == "array" and not _array_productive(node, root, productive_target):
            continue
        return True
    return False


def _object_productive(node: dict[str, Any], root: Any, productive: Callable[[int], bool]) -> bool:
    required = node.get("required")
    if not isinstance(required, list):
        return True
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    for name in required:
        if not isinstance(name, str):
            continue
        if name in properties:
            schema = properties[name]
        elif node.get("patternProperties"):
            continue  # a pattern may match the name: unsure
        else:
            schema = node.get("additionalProperties", True)
        if not _productive(schema, root, productive):
            return False
    return True


def _array_productive(node: dict[str, Any], root: Any, productive: Callable[[int], bool]) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or isinstance(min_items, bool) or min_items <= 0:
        return True
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    items = node.get("items", True)
    for index in range(min(min_items, len(prefix) + 1)):
        schema = prefix[index] if index < len(prefix) else items
        if isinstance(schema, dict | bool) and not _productive(schema, root, productive):
            return False
    return True


# ---------------------------------------------------------------- keywords that say nothing

#: ``propertyNames`` values every object key satisfies (JSON keys are strings): they
#: constrain nothing, so they are dropped before llguidance (which does not implement
#: ``propertyNames`` and refuses a schema with it). Zod-generated schemas (Claude Code's
#: tools) write ``"propertyNames": {"type": "string"}`` for every record.
_VACUOUS_PROPERTY_NAMES: tuple[Any, ...] = ({}, {"type": "string"})


def without_vacuous_keywords(schema: Any) -> Any:
    """``schema`` with every ``propertyNames`` that no key can fail removed, in the
    schema and all its subschemas (``$defs`` and ``definitions`` included); ``schema``
    itself (not a copy) when it has none. Other values are kept as they are: the result
    matches exactly the values ``schema`` matches."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    changed = False
    for key, value in schema.items():
        if key == "propertyNames" and (
            value is True or (isinstance(value, dict) and value in _VACUOUS_PROPERTY_NAMES)
        ):
            changed = True
            continue
        new = value
        if key in _ONE_SCHEMA:
            new = without_vacuous_keywords(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            items = [without_vacuous_keywords(item) for item in value]
            if any(a is not b for a, b in zip(items, value, strict=True)):
                new = items
        elif key in (*_SCHEMA_MAPS, "$defs", "definitions") and isinstance(value, dict):
            named = {name: without_vacuous_keywords(item) for name, item in value.items()}
            if any(named[name] is not item for name, item in value.items()):
                new = named
        changed = changed or new is not value
        out[key] = new
    return out if changed else schema


# ---------------------------------------------------------------- closed object schemas

#: Keywords that let an object have properties its ``properties`` do not list.
_OPENING = ("additionalProperties", "unevaluatedProperties")
#: Keywords that compose a schema with others (its properties may come from them).
_COMPOSING = ("allOf", "anyOf", "oneOf", "$ref")
#: Keywords whose value is a map of names to subschemas that are closed in turn.
_CLOSED_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is one subschema (or, for ``items``, a list) closed in turn.
_CLOSED_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
)


def close_object_schemas(schema: Any) -> Any:
    """``schema`` read as agents mean it (and as vLLM's default grammar backend,
    xgrammar, enforces it): an object schema generates only the properties it lists.

    A copy of ``schema`` in which every object schema with ``properties`` or
    ``patternProperties`` and neither ``additionalProperties`` nor
    ``unevaluatedProperties`` gets ``"additionalProperties": false``, all the way down
    (through ``properties``, ``patternProperties``, ``items``, ``prefixItems``,
    ``anyOf`` / ``oneOf``, ``$defs`` / ``definitions`` and the other subschema keywords).
    Left open, as JSON Schema reads them: an object schema without ``properties``
    (``{"type": "object"}`` is any object), one that says ``additionalProperties`` or
    ``unevaluatedProperties`` itself, one composed with ``allOf``, ``anyOf``, ``oneOf``
    or ``$ref`` beside its own properties, the parts of an ``allOf`` (closing each part
    would refuse the properties of the others), and whatever is under ``not``.

    Args:
        schema: a JSON Schema (a dict or a boolean; anything else is returned as is).

    Returns:
        The closed copy; ``schema`` itself is not changed.
    """
    root = json.loads(json.dumps(schema))  # a deep copy of plain JSON values
    stack: list[tuple[Any, bool]] = [(root, True)]
    while stack:  # an explicit stack: no recursion, whatever the depth
        node, closable = stack.pop()
        if not isinstance(node, dict):
            continue
        lists = any(isinstance(node.get(key), dict) for key in ("properties", "patternProperties"))
        composed = any(key in node for key in _COMPOSING)
        if closable and lists and not composed and not any(key in node for key in _OPENING):
            node["additionalProperties"] = False
        for key in _CLOSED_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend((sub, True) for sub in value.values())
        for key in _CLOSED_ONE:
            value = node.get(key)
            if isinstance(value, dict):
                stack.append((value, True))
            elif key == "items" and isinstance(value, list):
                stack.extend((sub, True) for sub in value)
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            stack.extend((sub, True) for sub in prefix)
        for key in ("anyOf", "oneOf"):  # alternatives: each one is the whole value
            value = node.get(key)
            if isinstance(value, list):
                stack.extend((sub, not lists) for sub in value)
        parts = node.get("allOf")
        if isinstance(parts, list):  # each part is one side of the value: left open
            stack.extend((part, False) for part in parts)
    return root
