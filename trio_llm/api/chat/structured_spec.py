"""The output constraint a request's fields ask for, as a `StructuredOutput`.

Three ways to ask: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and vLLM's
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
(`given_constraints` reads them all; a request may give at most one). Each builder checks
the shape only (a 400 naming the field); the size limits and the grammar are checked by
`trio_llm.api.chat.generation_request.GenerationRequest.structured_output`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.parsing import json_text_too_deep, nested_too_deep
from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.schema_rewrites import close_object_schemas


def json_spec(value: Any, name: str, close: bool = False) -> StructuredOutput | None:
    """A JSON Schema given as an object or as JSON text; with ``close``, its object
    schemas closed (`close_object_schemas`)."""
    if value is None:
        return None
    if isinstance(value, str):
        if json_text_too_deep(value):
            raise nested_too_deep(name)
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{name}: the schema is not valid JSON ({exc})", name) from exc
    if not isinstance(value, dict | bool):
        raise bad_request(f"{name}: a JSON Schema must be an object", name)
    if close:
        value = close_object_schemas(value)
    return StructuredOutput("json", json.dumps(value))


def _plain(kind: str, value: str | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput(kind, value)


def _choice_spec(value: list[str] | None, name: str) -> StructuredOutput | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{name} must list at least one choice", name)
    return StructuredOutput("choice", json.dumps(value))


def _from_response_format(value: dict[str, Any] | None, close: bool) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (its
    object schemas closed with ``close`` or ``strict: true``)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return StructuredOutput("json_object")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise bad_request(
                "response_format.json_schema must be an object with a name and a schema",
                "response_format",
            )
        close = close or schema.get("strict") is True
        return json_spec(schema.get("schema", {}), "response_format", close)
    raise bad_request(
        "response_format must be {type: text}, {type: json_object} or {type: json_schema, "
        "json_schema: {name, schema, strict}}",
        "response_format",
    )


#: vLLM's ``structured_outputs`` keys and the `StructuredOutput` kind of each.
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_structured_outputs(value: dict[str, Any] | None, close: bool) -> StructuredOutput | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object (other keys: a 400); a JSON Schema's objects closed with ``close``."""
    if value is None:
        return None
    name = "structured_outputs"
    given = {key: v for key, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(f"{name}: {unknown} are not supported by this server", name)
    if len(given) != 1:
        raise bad_request(f"{name} must give one of {list(_STRUCTURED_OUTPUTS_KEYS)}", name)
    ((key, spec),) = given.items()
    if key == "json":
        return json_spec(spec, name, close)
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise bad_request(f"{name}.choice must be a list of strings", name)
        return _choice_spec(spec, name)
    if not isinstance(spec, str):
        raise bad_request(f"{name}.{key} must be a string", name)
    return StructuredOutput(key, spec)


#: The fields that give an output constraint, each with its builder (the field's value,
#: whether to close object schemas).
CONSTRAINT_FIELDS: tuple[tuple[str, Callable[[Any, bool], StructuredOutput | None]], ...] = (
    ("response_format", _from_response_format),
    ("structured_outputs", _from_structured_outputs),
    ("guided_json", lambda value, close: json_spec(value, "guided_json", close)),
    ("guided_regex", lambda value, _: _plain("regex", value)),
    ("guided_choice", lambda value, _: _choice_spec(value, "guided_choice")),
    ("guided_grammar", lambda value, _: _plain("grammar", value)),
)


def given_constraints(request: object, close: bool) -> list[tuple[str, StructuredOutput]]:
    """The constraints ``request`` gives in its `CONSTRAINT_FIELDS`, as ``(field name,
    spec)`` in that order; JSON Schemas' objects closed with ``close``
    (`close_object_schemas`).

    Raises:
        APIError: a 400 naming the field whose value is malformed.
    """
    found = [(name, build(getattr(request, name), close)) for name, build in CONSTRAINT_FIELDS]
    return [(name, spec) for name, spec in found if spec is not None]
