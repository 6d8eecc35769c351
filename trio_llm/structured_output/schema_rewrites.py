"""Rewrites of a JSON Schema before llguidance compiles it, each keeping what the schema
means to its users: keywords that constrain nothing are dropped
(`without_vacuous_keywords`), and object schemas are closed to the properties they list
(`close_object_schemas`, agents' reading of them).
"""

from __future__ import annotations

import json
from typing import Any

from trio_llm.structured_output.unsatisfiable import ONE_SCHEMA, SCHEMA_LISTS, SCHEMA_MAPS

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
        if key in ONE_SCHEMA:
            new = without_vacuous_keywords(value)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            items = [without_vacuous_keywords(item) for item in value]
            if any(a is not b for a, b in zip(items, value, strict=True)):
                new = items
        elif key in (*SCHEMA_MAPS, "$defs", "definitions") and isinstance(value, dict):
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
