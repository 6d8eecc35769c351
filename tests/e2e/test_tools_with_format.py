"""Tools and a response format in one request, against the shared server (SmolLM2,
``--tool-call-parser hermes``), through the openai SDK: the agent pattern "tools plus a
typed answer" (issue 31). With tool_choice "auto" the output is valid calls or an answer
valid against the format; a forced call with a schema that does not close its objects
still ends at its last listed key; a call cut off by max_tokens never leaks into content.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL
from tests.e2e.test_tool_calls_api import (
    ONE_SHOT,
    QUESTION,
    TOOLS,
    _calls,
    _greedy_choice,
    _streamed,
)
from tests.support.tool_schemas import SCHEMAS, weather_call

#: An agent's typed answer, as pydantic writes it (no additionalProperties).
ANSWER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "summary": {"type": "string", "maxLength": 60},
    },
    "required": ["city", "summary"],
    "title": "Weather",
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": ANSWER}}

#: The history after the tool ran: the last message is its result.
AFTER_RESULT = [
    *QUESTION,
    weather_call("Paris"),
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def _check_calls_or_answer(message: Any) -> str:
    """``calls`` (each valid against its tool) or ``answer`` (valid against the format)."""
    calls = _calls(message)
    if calls:
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert not message.content
        return "calls"
    answer = json.loads(message.content)
    jsonschema.validate(answer, {**ANSWER, "additionalProperties": False})
    return "answer"


@pytest.mark.parametrize("messages", [ONE_SHOT, AFTER_RESULT], ids=["question", "after-result"])
def test_auto_with_a_format_gives_valid_calls_or_a_valid_answer(
    client: OpenAI, messages: list
) -> None:
    kwargs, choice = _greedy_choice(client, messages, response_format=FORMAT)
    kind = _check_calls_or_answer(choice.message)
    assert choice.finish_reason == ("tool_calls" if kind == "calls" else "stop")
    assert _streamed(client, **kwargs) == (
        choice.message.content,
        _calls(choice.message),
        choice.finish_reason,
    )


def test_a_forced_call_with_an_open_schema_ends_at_its_listed_keys(client: OpenAI) -> None:
    open_schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": open_schema}}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=200,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    ((name, arguments),) = _calls(choice.message)
    assert name == "get_weather"
    assert set(json.loads(arguments)) == {"city"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_cut_off_by_max_tokens_is_no_content(client: OpenAI, stream: bool) -> None:
    kwargs = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
    }
    for max_tokens in (2, 5, 12):  # inside the first call's head, its arguments, or later
        if stream:
            content, calls, finish = _streamed(client, max_tokens=max_tokens, **kwargs)
        else:
            choice = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
            content, calls, finish = (
                choice.message.content,
                _calls(choice.message),
                choice.finish_reason,
            )
        assert not content, (max_tokens, content)
        assert finish == "length", (max_tokens, finish)
        assert all(name in SCHEMAS for name, _ in calls)
