"""A whole tool-calling round trip through the official openai client: the model calls a
function, the program runs it, the result goes back, and the model answers in text.

make serve                      # in one terminal (it enables tool_choice "auto", hermes)
.venv/bin/python examples/tool_calls.py "What is the weather in Paris?"
.venv/bin/python examples/tool_calls.py --tool-choice auto "What is the weather in Oslo?"

The default tool_choice is "required": the server's grammar then guarantees a valid call,
even from the small default model, which seldom decides to call a tool on its own.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]


def get_weather(city: str, unit: str) -> dict:
    """A stand-in for a real weather service."""
    celsius = 18
    temperature = celsius if unit == "celsius" else celsius * 9 / 5 + 32
    return {"city": city, "temperature": temperature, "unit": unit, "sky": "light rain"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="*", default=["What is the weather in Paris?"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tool-choice", default="required", choices=["required", "auto"])
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    messages: list[dict] = [{"role": "user", "content": " ".join(args.question)}]

    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=args.tool_choice, temperature=0
    )
    message = first.choices[0].message
    if not message.tool_calls:  # "auto": the model chose to answer directly
        print(f"answer: {message.content}")
        return
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        result = get_weather(**arguments)
        print(f"call: {call.function.name}({call.function.arguments}) -> {json.dumps(result)}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

    # With the result in the history, ask for the answer in words.
    final = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=64,
    )
    print(f"answer: {final.choices[0].message.content}")


if __name__ == "__main__":
    main()
