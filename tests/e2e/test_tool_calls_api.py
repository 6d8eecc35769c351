"""Tool calls over HTTP against the shared server (SmolLM2 with trio_llm's tool template,
``--enable-auto-tool-choice --tool-call-parser hermes``), through the official openai SDK:
forced calls are valid against their schemas, and a stream carries the same calls as the
whole response."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL
from tests.support.tool_schemas import ADD, SCHEMAS, WEATHER, weather_call

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

#: One earlier turn in which the assistant called the tool: the small model then calls it
#: again on its own (tool_choice "auto").
ONE_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    weather_call("London"),
    *QUESTION,
]


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def _create(client: OpenAI, messages: list, **fields: Any) -> Any:
    """A chat completion of ``messages`` with `TOOLS` and ``fields``."""
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **fields)


def _greedy_choice(client: OpenAI, messages: list, **fields: Any) -> tuple[dict[str, Any], Any]:
    """The arguments of a greedy chat completion of ``messages`` with `TOOLS` (100 tokens
    at most) and ``fields``, and its first choice."""
    kwargs = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, **fields}
    kwargs["max_tokens"] = 100
    return kwargs, client.chat.completions.create(**kwargs).choices[0]


def _streamed(client: OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str]:
    """Content, calls and finish_reason, accumulated from the stream as its docs show."""
    content, calls, finish = "", {}, ""
    ids = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            # At most one entry per call in a chunk (a naive client appends, not merges).
            indexes = [piece.index for piece in choice.delta.tool_calls or ()]
            assert len(indexes) == len(set(indexes)), choice.delta.tool_calls
            for piece in choice.delta.tool_calls or ():
                if piece.id is not None:
                    assert piece.function.name and piece.id not in ids
                    ids.add(piece.id)
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("messages", "tool_choice"),
    [
        (QUESTION, "required"),
        (QUESTION, {"type": "function", "function": {"name": "add"}}),
        (ONE_SHOT, "auto"),
    ],
    ids=["required", "named", "auto"],
)
def test_a_call_is_valid_and_streams_as_it_is_returned(
    client: OpenAI, messages: list, tool_choice: Any
) -> None:
    kwargs, choice = _greedy_choice(client, messages, tool_choice=tool_choice)
    calls = _calls(choice.message)
    assert calls, choice.message
    assert choice.finish_reason == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["add"]
    assert _streamed(client, **kwargs) == (choice.message.content, calls, "tool_calls")


def test_sampled_forced_calls_all_validate(client: OpenAI) -> None:
    response = _create(
        client,
        QUESTION,
        tool_choice="required",
        temperature=1,
        seed=7,
        n=8,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    for choice in response.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        ((name, arguments),) = _calls(choice.message)  # one call: parallel_tool_calls false
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_choice_none_answers_in_text(client: OpenAI) -> None:
    response = _create(client, QUESTION, tool_choice="none", max_tokens=24)
    message = response.choices[0].message
    assert message.content
    assert not message.tool_calls
    assert response.choices[0].finish_reason in ("stop", "length")


def test_a_round_trip_ends_in_a_text_answer(client: OpenAI) -> None:
    """Call, tool result, answer: the history with the call and its result is accepted
    (its rendering is checked in tests/unit/api/tools/test_tool_calls.py; whether a 135M model uses
    the result well is not this test's business)."""
    first = _create(
        client,
        QUESTION,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Paris"
    result = {"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "light rain"}
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    final = _create(client, history, tool_choice="none", temperature=0, max_tokens=48)
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and result
