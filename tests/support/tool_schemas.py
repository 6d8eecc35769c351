"""The tools the e2e tool-call tests share: their argument schemas (each API wraps them in
its own tool shape), the chat tools of another API's, and a turn that called one; and
`closed_object`, the JSON schema of an object with exactly the properties listed."""

from __future__ import annotations

import json
from typing import Any


def closed_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """The schema of an object with all of ``properties`` (in this order) and no other."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


#: ``get_weather``'s arguments: a short city name and a unit.
WEATHER = closed_object(
    city={"type": "string", "maxLength": 20}, unit={"enum": ["celsius", "fahrenheit"]}
)
#: ``add``'s arguments: two integers.
ADD = closed_object(a={"type": "integer"}, b={"type": "integer"})
#: Each tool's arguments schema, by name.
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
#: A question the model answers with a ``get_weather`` call.
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_tools(tools: list[dict[str, Any]], schema_key: str) -> list[dict[str, Any]]:
    """``tools`` (each with a name, a description and its schema under ``schema_key``)
    as chat completions take them."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool["description"],
                "parameters": tool[schema_key],
            },
        }
        for tool in tools
    ]


def weather_call(city: str) -> dict[str, Any]:
    """The assistant's chat message calling ``get_weather`` for ``city`` in celsius
    (call id ``call_1``)."""
    arguments = json.dumps({"city": city, "unit": "celsius"})
    function = {"name": "get_weather", "arguments": arguments}
    return {
        "role": "assistant",
        "tool_calls": [{"id": "call_1", "type": "function", "function": function}],
    }
