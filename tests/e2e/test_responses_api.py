"""The stateless OpenAI Responses API (``POST /v1/responses``) against the shared server,
through the official openai SDK: a greedy response says what the greedy chat completion of
the same conversation says, with the same token counts; a stream carries the same response
in the protocol's order, numbered from 0; function calls are valid against their schemas;
what this server does not take (images, unknown tool types, prompt templates) is a 400
naming the field. Stored responses: tests/e2e/test_stored_responses.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel

from tests.e2e.conftest import MODEL, parallel
from tests.support.sse import names_and_data
from tests.support.tool_schemas import ADD, SCHEMAS, WEATHER, WEATHER_QUESTION, chat_tools

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a helpful assistant."
#: The same conversation as chat messages (the reference).
CHAT_QUESTION = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": QUESTION},
]

#: Function tools in the Responses API's flat shape...
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER,
    },
    {"type": "function", "name": "add", "description": "a + b", "parameters": ADD},
]
#: ...and as chat completions take them.
CHAT_TOOLS = chat_tools(TOOLS, "parameters")

#: A text response's events in order (OpenAI's "Streaming API responses").
TEXT_EVENTS = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added"
    r" response\.content_part\.added( response\.output_text\.delta)+"
    r" response\.output_text\.done response\.content_part\.done response\.output_item\.done"
    r" response\.(completed|incomplete)"
)
#: A response of function calls only.
CALL_EVENTS = re.compile(
    r"response\.created response\.in_progress"
    r"( response\.output_item\.added( response\.function_call_arguments\.delta)*"
    r" response\.function_call_arguments\.done response\.output_item\.done)+"
    r" response\.completed"
)


def _greedy_chat(client: OpenAI, messages: list[dict], max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def _greedy_response(client: OpenAI, prompt: Any, max_output_tokens: int, **kwargs: Any) -> Any:
    return client.responses.create(
        model=MODEL, input=prompt, temperature=0, max_output_tokens=max_output_tokens, **kwargs
    )


def _greedy_question(max_output_tokens: int) -> dict[str, Any]:
    """The arguments of a greedy response to `QUESTION` with `INSTRUCTIONS`."""
    return {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
    }


def _whole_and_streamed(client: OpenAI, kwargs: dict[str, Any], other: Callable[[], Any]) -> list:
    """The response to ``kwargs``, its stream's events and ``other()``, asked for at once
    (the server batches them)."""
    return parallel(
        lambda: client.responses.create(**kwargs),
        lambda: list(client.responses.create(stream=True, **kwargs)),
        other,
    )


def _types(events: list[Any]) -> str:
    return " ".join(event.type for event in events)


def _calls(output: list[Any]) -> list[tuple[str, Any]]:
    """The function_call items of ``output`` as (name, parsed arguments)."""
    assert all(item.type == "function_call" for item in output), output
    return [(item.name, json.loads(item.arguments)) for item in output]


def _chat_calls(message: Any) -> list[tuple[str, Any]]:
    return [
        (call.function.name, json.loads(call.function.arguments))
        for call in message.tool_calls or ()
    ]


def test_instructions_and_input_answer_as_chat_does(client: OpenAI) -> None:
    response, chat = parallel(
        lambda: _greedy_response(client, QUESTION, 40, instructions=INSTRUCTIONS),
        lambda: _greedy_chat(client, CHAT_QUESTION, 40),
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None
    assert response.instructions == INSTRUCTIONS
    (item,) = response.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    (part,) = item.content
    assert part.type == "output_text" and part.text == choice.message.content
    assert response.output_text == choice.message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens


def test_message_items_answer_as_chat_messages_do(client: OpenAI) -> None:
    """Input items (a developer message and a user message of input_text parts) are the
    chat messages of the same roles and text."""
    items = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Answer in one word."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    messages = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    response, chat = parallel(
        lambda: _greedy_response(client, items, 12),
        lambda: _greedy_chat(client, messages, 12),
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_makes_the_response_incomplete(client: OpenAI) -> None:
    kwargs = _greedy_question(4)
    response, events, chat = _whole_and_streamed(
        client, kwargs, lambda: _greedy_chat(client, CHAT_QUESTION, 4)
    )
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == 4
    assert TEXT_EVENTS.fullmatch(_types(events)), _types(events)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == response.output_text
    assert last.response.usage.output_tokens == 4
    # The cut-off message item says so, in the response and in its done event.
    assert response.output[-1].status == "incomplete"
    assert last.response.output[-1].status == "incomplete"
    done = [event for event in events if event.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"


def test_a_stream_carries_the_response_in_protocol_order(client: OpenAI) -> None:
    kwargs = _greedy_question(40)

    def helper() -> Any:
        with client.responses.stream(**kwargs) as stream:
            return stream.get_final_response()

    whole, events, final = _whole_and_streamed(client, kwargs, helper)
    assert whole.status == "completed"
    assert TEXT_EVENTS.fullmatch(_types(events)), _types(events)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    created, in_progress = events[0].response, events[1].response
    assert created.status == in_progress.status == "in_progress"
    assert created.output == [] and created.id == in_progress.id
    by_type = {event.type: event for event in events}
    item = by_type["response.output_item.added"].item
    assert (item.type, item.status, item.content) == ("message", "in_progress", [])
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    # The message item's events: all but the response's own, first two and last.
    located = events[2:-1]
    assert {event.output_index for event in located} == {0}
    assert {event.item_id for event in located if hasattr(event, "item_id")} == {item.id}
    assert {event.content_index for event in located if hasattr(event, "content_index")} == {0}
    text = whole.output_text
    assert "".join(event.delta for event in deltas) == text
    assert by_type["response.output_text.done"].text == text
    assert by_type["response.content_part.done"].part.text == text
    done = by_type["response.output_item.done"].item
    assert (done.id, done.status, done.content[0].text) == (item.id, "completed", text)
    completed = by_type["response.completed"].response
    assert completed.id == created.id
    assert completed.status == "completed"
    assert completed.output_text == text
    # Equal but for the prefix-cache hits (the second request finds the prompt cached).
    totals = ("input_tokens", "output_tokens", "total_tokens")
    assert [getattr(completed.usage, k) for k in totals] == [
        getattr(whole.usage, k) for k in totals
    ]
    assert final.output_text == text  # the SDK's own accumulation


def test_each_raw_event_is_named_by_its_type(base_url: str) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        names, datas = names_and_data(response.iter_lines())
    assert names == [data["type"] for data in datas]
    assert [data["sequence_number"] for data in datas] == list(range(len(datas)))


@pytest.mark.parametrize(
    ("tool_choice", "chat_choice"),
    [
        ("required", "required"),
        ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
    ids=["required", "named"],
)
def test_a_forced_function_call_is_valid_and_streams_as_it_is_returned(
    client: OpenAI, tool_choice: Any, chat_choice: Any
) -> None:
    kwargs = {
        "model": MODEL,
        "input": WEATHER_QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_output_tokens": 100,
        "temperature": 0,
    }
    response, events, chat = _whole_and_streamed(
        client,
        kwargs,
        lambda: _greedy_chat(
            client, WEATHER_QUESTION, 100, tools=CHAT_TOOLS, tool_choice=chat_choice
        ),
    )
    assert response.status == "completed"
    calls = _calls(response.output)
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["add"]
    call_ids = [item.call_id for item in response.output]
    assert all(call_ids) and len(set(call_ids)) == len(call_ids)
    assert all(item.status == "completed" for item in response.output)
    # The same calls as chat's, for the same prompt.
    assert chat.choices[0].finish_reason == "tool_calls"
    assert calls == _chat_calls(chat.choices[0].message)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    # The stream: each call's arguments arrive in delta events, whole in the done events.
    assert CALL_EVENTS.fullmatch(_types(events)), _types(events)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, item.name, item.arguments) for item in added] == [
        ("function_call", name, "") for name, _ in calls
    ]
    for index, (item, (_, arguments)) in enumerate(zip(added, calls, strict=True)):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert {e.item_id for e in mine if hasattr(e, "item_id")} == {item.id}
        pieces = [e.delta for e in mine if e.type == "response.function_call_arguments.delta"]
        (done,) = [e for e in mine if e.type == "response.function_call_arguments.done"]
        assert json.loads("".join(pieces)) == json.loads(done.arguments) == arguments
    completed = events[-1].response
    assert completed.status == "completed"
    assert _calls(completed.output) == calls
    assert completed.usage.output_tokens == response.usage.output_tokens


def test_a_function_call_round_trip_is_answered(client: OpenAI) -> None:
    """Call, output, answer: the output items passed back with a function_call_output are
    read as chat reads the same call and result (same prompt, same greedy answer)."""
    first = _greedy_response(
        client,
        WEATHER_QUESTION,
        60,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "rain"})
    # As OpenAI's function-calling guide does it: the output items go back as input.
    items = [
        *WEATHER_QUESTION,
        *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    chat_history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    final, chat = parallel(
        lambda: _greedy_response(client, items, 32, tools=TOOLS, tool_choice="none"),
        lambda: _greedy_chat(client, chat_history, 32, tools=CHAT_TOOLS, tool_choice="none"),
    )
    (item,) = final.output
    assert item.type == "message"
    assert final.output_text
    assert final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.input_tokens > first.usage.input_tokens + 20  # the call and result


class City(BaseModel):
    name: Literal["Paris", "Rome", "Berlin"]
    country: Literal["France", "Italy", "Germany"]
    is_capital: bool


def test_the_sdk_parses_a_text_format(client: OpenAI) -> None:
    question = "Describe Paris as JSON."
    response, chat = parallel(
        lambda: client.responses.parse(
            model=MODEL, input=question, text_format=City, max_output_tokens=60, temperature=0
        ),
        lambda: client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=City,
            max_tokens=60,
            temperature=0,
        ),
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)
    assert response.output_parsed == chat.choices[0].message.parsed
    assert response.output_text == chat.choices[0].message.content


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("prompt", {"prompt": {"id": "pmpt_1"}}, "prompt"),
    (
        "input_image",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "https://example.com/a.png"},
                    ],
                }
            ]
        },
        "input",
    ),
    ("unknown tool type", {"tools": [{"type": "teleport"}]}, "tools"),
    ("text.format xml", {"text": {"format": {"type": "xml"}}}, "text"),
    (
        "json_schema without a name",
        {"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        "text",
    ),
    ("temperature above 2", {"temperature": 2.5}, "temperature"),
    ("background without store", {"background": True, "store": False}, "background"),
    ("background stream", {"background": True, "stream": True}, "stream"),
    ("conversation of the wrong shape", {"conversation": {"name": "x"}}, "conversation"),
]


@pytest.mark.parametrize(("fields", "param"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_a_bad_request_is_a_400_naming_the_field(
    base_url: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 5, **fields}
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error == {
        "error": {
            "message": error["error"]["message"],
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    assert error["error"]["message"]


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
#: Bad requests whose error must name the Responses field, in ``param`` and in a
#: one-line message (the checks behind them are the chat path's).
BAD_IN_RESPONSES_TERMS: list[tuple[str, dict[str, Any], str, str]] = [
    ("surrogate in metadata", {"metadata": {"k": "\ud800"}}, "metadata", "metadata"),
    ("surrogate in a tool", {"tools": [{**FUNCTION, "x": "\ud800"}]}, "tools", "tools"),
    ("surrogate in text", {"text": {"format": {"type": "text", "x": "\ud800"}}}, "text", "text"),
    (
        "surrogate in tool_choice",
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "f", "x": "\ud800"}},
        "tool_choice",
        "tool_choice",
    ),
    (
        "tool_choice name of the wrong type",
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": 5}},
        "tool_choice",
        "tool_choice",
    ),
    # max_output_tokens past the context is clamped (a 400 only with --max-tokens-policy
    # strict): tests/unit/api/chat/test_context_errors.py.
    (
        "schema the grammar cannot enforce",
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "array", "uniqueItems": True},
                }
            }
        },
        "text",
        "text",
    ),
    ("reasoning as a string", {"reasoning": "high"}, "reasoning", "reasoning"),
    ("background 0", {"background": 0}, "background", "background"),
    (
        "a call without its tools",
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "done"},
            ]
        },
        "tools",
        "tools",
    ),
]


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [case[1:] for case in BAD_IN_RESPONSES_TERMS],
    ids=[case[0] for case in BAD_IN_RESPONSES_TERMS],
)
def test_errors_name_the_responses_field(
    base_url: str, fields: dict[str, Any], param: str, fragment: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 5, **fields}
    for stream in (False, True):
        # json.dumps escapes a lone surrogate as JSON may (httpx's json= cannot send one).
        response = httpx.post(
            f"{base_url}/v1/responses",
            content=json.dumps({**body, "stream": stream}),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        assert fragment in error["message"] and "\n" not in error["message"], error
        for chat_name in ("response_format", "max_tokens=", "ChatCompletionRequest"):
            assert chat_name not in error["message"], error


def test_null_fields_mean_their_defaults(base_url: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "temperature": 0}
    nulls = {"stream": None, "parallel_tool_calls": None, "store": None, "tools": None}
    plain, with_nulls = (
        httpx.post(f"{base_url}/v1/responses", json=b, timeout=60)
        for b in (body, {**body, **nulls})
    )
    assert plain.status_code == with_nulls.status_code == 200, with_nulls.text
    assert plain.json()["output"][0]["content"] == with_nulls.json()["output"][0]["content"]


def test_the_sdk_raises_the_error_it_was_sent(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=5, temperature=3)
    assert raised.value.status_code == 400
    assert raised.value.param == "temperature"


def test_an_unknown_model_is_not_found(base_url: str) -> None:
    body = {"model": "gpt-nonexistent", "input": "hi"}
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("not_found_error", "model")
    assert "gpt-nonexistent" in error["message"]
