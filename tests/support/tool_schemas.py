"""The tools' argument schemas the e2e tool-call tests share (each API wraps them in its
own tool shape)."""

from __future__ import annotations

#: ``get_weather``'s arguments: a short city name and a unit.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
#: ``add``'s arguments: two integers.
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
