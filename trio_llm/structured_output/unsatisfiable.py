"""JSON Schemas that no finite value matches (`unsatisfiable_reason`), found from the
schema's JSON alone (a few passes over its ``$ref`` targets), and the keywords whose values
are subschemas (`ONE_SCHEMA`, `SCHEMA_LISTS`, `SCHEMA_MAPS`) that the rewrites of
`schema_rewrites` walk too.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

#: Keywords whose value is one subschema, a list of them, or a map of names to them
#: (the values of ``enum``, ``const``, ``default`` and ``examples`` are data, not schemas;
#: ``$defs`` and ``definitions`` are reached through ``$ref`` only).
ONE_SCHEMA = (
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
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")


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

    least = _fixed_point(targets, root, grow=True)
    greatest = _fixed_point(targets, root, grow=False)
    for key, (ref, _) in targets.items():
        if key in greatest and key not in least:
            where = "the schema" if ref == "#" else f"the subschema {ref}"
            return (
                f"{where} matches no JSON value: it requires itself through $ref without "
                "end, so every value would be infinitely deep"
            )
    return None


def _fixed_point(targets: dict[int, tuple[str, Any]], root: Any, *, grow: bool) -> set[int]:
    """The ids of the ``targets`` (by ``id``: ``(ref, node)``) that are productive: the
    least fixed point when ``grow`` (from none, adding each target productive given the
    set so far), else the greatest (from all, removing each target that is not)."""
    current: set[int] = set() if grow else set(targets)
    changed = True
    while changed:
        changed = False
        for key, (_, node) in targets.items():
            if (key in current) != grow and _productive(node, root, current.__contains__) == grow:
                (current.add if grow else current.discard)(key)
                changed = True
    return current


def _subschemas(node: dict[str, Any]) -> Iterator[Any]:
    """The subschemas of ``node`` (one level), as `ONE_SCHEMA`, `SCHEMA_LISTS` and
    `SCHEMA_MAPS` name them."""
    for name in ONE_SCHEMA:
        value = node.get(name)
        if isinstance(value, dict):
            yield value
    for name in SCHEMA_LISTS:
        value = node.get(name)
        if isinstance(value, list):
            yield from value
    for name in SCHEMA_MAPS:
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
