"""The Anthropic Messages API (``POST /v1/messages``) against the shared server, through
the official anthropic SDK: a greedy message says what the greedy chat completion of the
same conversation says, with the same token counts; a stream carries the same message, in
the protocol's order; tool calls are valid against their schemas; bad requests get
Anthropic's error body."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from anthropic import Anthropic, BadRequestError
from openai import OpenAI
from pydantic import BaseModel

from tests.e2e.conftest import MODEL, parallel
from tests.support.sse import names_and_data
from tests.support.tool_schemas import (
    ADD,
    SCHEMAS,
    WEATHER,
    WEATHER_QUESTION,
    chat_tools,
    closed_object,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: anthropic 2.15's ``messages.create`` has no sampling keywords: they go in the body.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}

TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
    {"name": "add", "description": "a + b", "input_schema": ADD},
]
#: The same tools as chat completions take them (the reference).
CHAT_TOOLS = chat_tools(TOOLS, "input_schema")

#: Chat finish reasons as the Messages API's stop reasons (no stop sequence given).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _prompt_tokens(usage: Any) -> int:
    """The prompt's tokens: Anthropic counts those read from the prompt cache apart from
    ``input_tokens``."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


#: The event types of a Messages stream (the SDK adds its own, e.g. "text").
WIRE_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
}
#: A stream's event types in order (pings aside), Anthropic's "Streaming messages" flow.
EVENT_ORDER = re.compile(
    r"message_start( content_block_start( content_block_delta)* content_block_stop)*"
    r" message_delta message_stop"
)


@pytest.fixture
def anthropic(base_url: str) -> Iterator[Anthropic]:
    """The official client (the SDK adds ``/v1/messages``; no retries: every answer counts)."""
    with Anthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
        yield client


def _blocks(content: list[Any]) -> list[tuple[Any, ...]]:
    """Content blocks as comparable tuples (the SDK's parsed and plain types differ)."""
    out: list[tuple[Any, ...]] = []
    for block in content:
        if block.type == "text":
            out.append(("text", block.text))
        else:
            assert block.type == "tool_use", block
            out.append(("tool_use", block.name, block.input))
    return out


def _chat_blocks(message: Any) -> list[tuple[Any, ...]]:
    """A chat message's content and calls as `_blocks` writes a message's content."""
    out: list[tuple[Any, ...]] = [("text", message.content)] if message.content else []
    for call in message.tool_calls or ():
        out.append(("tool_use", call.function.name, json.loads(call.function.arguments)))
    return out


def _event_types(events: list[Any]) -> str:
    return " ".join(event.type for event in events if event.type in WIRE_EVENTS - {"ping"})


def _greedy_chat(client: OpenAI, messages: list[dict], max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


@pytest.mark.parametrize(("max_tokens", "finish"), [(5, "length"), (40, "stop")])
def test_a_greedy_message_says_what_chat_says(
    anthropic: Anthropic, client: OpenAI, max_tokens: int, finish: str
) -> None:
    message, chat = parallel(
        lambda: anthropic.messages.create(
            model=MODEL, max_tokens=max_tokens, messages=QUESTION, **GREEDY
        ),
        lambda: _greedy_chat(client, QUESTION, max_tokens),
    )
    choice = chat.choices[0]
    assert choice.finish_reason == finish  # both ways of ending are covered
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert message.id.startswith("msg_")
    assert _blocks(message.content) == [("text", choice.message.content)]
    assert message.stop_reason == STOP_REASONS[finish]
    assert message.stop_sequence is None
    assert _prompt_tokens(message.usage) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_a_system_prompt_as_a_string_or_as_text_blocks(
    anthropic: Anthropic, client: OpenAI
) -> None:
    system = "You are a terse assistant. Answer in one word."
    as_blocks = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    as_string, in_blocks, chat = parallel(
        lambda: anthropic.messages.create(
            model=MODEL, max_tokens=24, system=system, messages=QUESTION, **GREEDY
        ),
        lambda: anthropic.messages.create(
            model=MODEL,
            max_tokens=24,
            system=[{"type": "text", "text": system}],
            messages=as_blocks,
            **GREEDY,
        ),
        lambda: _greedy_chat(client, [{"role": "system", "content": system}, *QUESTION], 24),
    )
    expected = _chat_blocks(chat.choices[0].message)
    assert _blocks(as_string.content) == _blocks(in_blocks.content) == expected
    assert _prompt_tokens(as_string.usage) == _prompt_tokens(in_blocks.usage)
    assert _prompt_tokens(as_string.usage) == chat.usage.prompt_tokens


def test_a_stop_sequence_ends_the_message_before_it(anthropic: Anthropic) -> None:
    whole = anthropic.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, **GREEDY)
    ((_, text),) = _blocks(whole.content)
    words = text.split()
    assert len(words) >= 3, text
    stop = words[len(words) // 2]
    expected = text[: text.index(stop)]
    assert expected  # a block of text comes before the stop sequence
    kwargs = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": QUESTION,
        "stop_sequences": ["no such text", stop],
        **GREEDY,
    }

    def streamed() -> tuple[str, Any]:
        with anthropic.messages.stream(**kwargs) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    stopped, (streamed_text, final) = parallel(
        lambda: anthropic.messages.create(**kwargs), streamed
    )
    for message in (stopped, final):
        assert _blocks(message.content) == [("text", expected)]
        assert message.stop_reason == "stop_sequence"
        assert message.stop_sequence == stop
    assert streamed_text == expected
    assert final.usage.output_tokens == stopped.usage.output_tokens < whole.usage.output_tokens


def test_a_stream_carries_the_message_in_protocol_order(anthropic: Anthropic) -> None:
    kwargs = {"model": MODEL, "max_tokens": 24, "messages": QUESTION, **GREEDY}

    def events() -> list[Any]:
        with anthropic.messages.stream(**kwargs) as stream:
            return list(stream)

    def text_and_final() -> tuple[str, Any]:
        with anthropic.messages.stream(**kwargs) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    whole, seen, (text, final) = parallel(
        lambda: anthropic.messages.create(**kwargs), events, text_and_final
    )
    ((_, whole_text),) = _blocks(whole.content)
    assert EVENT_ORDER.fullmatch(_event_types(seen)), _event_types(seen)
    start = seen[0]
    assert start.message.content == [] and start.message.stop_reason is None
    assert _prompt_tokens(start.message.usage) == _prompt_tokens(whole.usage)
    deltas = [event for event in seen if event.type == "content_block_delta"]
    assert {event.index for event in deltas} == {0}
    assert all(event.delta.type == "text_delta" for event in deltas)
    assert "".join(event.delta.text for event in deltas) == whole_text
    (finished,) = [event for event in seen if event.type == "message_delta"]
    assert finished.delta.stop_reason == whole.stop_reason
    assert finished.usage.output_tokens == whole.usage.output_tokens
    assert text == whole_text
    assert _blocks(final.content) == _blocks(whole.content)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_each_raw_event_is_named_by_its_type(base_url: str) -> None:
    """On the wire: ``event: NAME`` lines naming each ``data:`` object's type (the SDK
    dispatches on the name), pings allowed anywhere after message_start."""
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": QUESTION,
        "temperature": 0,
        "stream": True,
    }
    headers = {"anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{base_url}/v1/messages", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        names, datas = names_and_data(response.iter_lines())
    assert names == [data["type"] for data in datas]
    assert set(names) <= WIRE_EVENTS
    assert names[0] == "message_start"
    assert EVENT_ORDER.fullmatch(" ".join(name for name in names if name != "ping")), names


@pytest.mark.parametrize(
    ("tool_choice", "chat_choice"),
    [
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
    ids=["any", "named"],
)
def test_a_forced_tool_use_is_valid_and_streams_as_it_is_returned(
    anthropic: Anthropic, client: OpenAI, tool_choice: dict, chat_choice: Any
) -> None:
    kwargs = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": WEATHER_QUESTION,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        **GREEDY,
    }

    def streamed() -> tuple[list[Any], Any]:
        with anthropic.messages.stream(**kwargs) as stream:
            return list(stream), stream.get_final_message()

    message, (seen, final), chat = parallel(
        lambda: anthropic.messages.create(**kwargs),
        streamed,
        lambda: _greedy_chat(
            client, WEATHER_QUESTION, 100, tools=CHAT_TOOLS, tool_choice=chat_choice
        ),
    )
    blocks = _blocks(message.content)
    assert blocks and all(block[0] == "tool_use" for block in blocks), blocks
    for _, name, arguments in blocks:
        jsonschema.validate(arguments, SCHEMAS[name])
    if tool_choice["type"] == "tool":
        assert [name for _, name, _ in blocks] == ["add"]
    ids = [block.id for block in message.content]
    assert all(ids) and len(set(ids)) == len(ids)
    assert message.stop_reason == "tool_use"
    # The same calls as chat's, for the same prompt.
    assert chat.choices[0].finish_reason == "tool_calls"
    assert blocks == _chat_blocks(chat.choices[0].message)
    assert _prompt_tokens(message.usage) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    # The stream: each tool_use block opens with an empty input and carries its JSON in
    # input_json_delta pieces.
    assert EVENT_ORDER.fullmatch(_event_types(seen)), _event_types(seen)
    starts = [event for event in seen if event.type == "content_block_start"]
    assert [(e.content_block.type, e.content_block.name) for e in starts] == [
        ("tool_use", name) for _, name, _ in blocks
    ]
    assert all(event.content_block.input == {} for event in starts)
    for index, (_, _, arguments) in enumerate(blocks):
        pieces = [
            event.delta
            for event in seen
            if event.type == "content_block_delta" and event.index == index
        ]
        assert all(piece.type == "input_json_delta" for piece in pieces)
        assert json.loads("".join(piece.partial_json for piece in pieces)) == arguments
    assert _blocks(final.content) == blocks
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == message.usage.output_tokens


def test_a_tool_result_round_trip_is_answered(anthropic: Anthropic, client: OpenAI) -> None:
    """Call, tool result, answer: the history with the tool_use and tool_result blocks is
    read as chat reads the same call and result (same prompt, same greedy answer)."""
    first = anthropic.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "rain"})
    history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": [block.model_dump(exclude_none=True) for block in first.content],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
        },
    ]
    chat_history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    final, chat = parallel(
        lambda: anthropic.messages.create(
            model=MODEL,
            max_tokens=32,
            messages=history,
            tools=TOOLS,
            tool_choice={"type": "none"},
            **GREEDY,
        ),
        lambda: _greedy_chat(client, chat_history, 32, tools=CHAT_TOOLS, tool_choice="none"),
    )
    ((kind, text),) = _blocks(final.content)
    assert kind == "text" and text
    assert _blocks(final.content) == _chat_blocks(chat.choices[0].message)
    assert final.stop_reason == STOP_REASONS[chat.choices[0].finish_reason]
    assert _prompt_tokens(final.usage) == chat.usage.prompt_tokens
    assert _prompt_tokens(final.usage) > _prompt_tokens(first.usage) + 20  # the call and result


class City(BaseModel):
    name: Literal["Paris", "Rome", "Berlin"]
    country: Literal["France", "Italy", "Germany"]
    is_capital: bool


def test_the_sdk_parses_an_output_format(anthropic: Anthropic) -> None:
    message = anthropic.messages.parse(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        output_format=City,
        **GREEDY,
    )
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, City)


def test_an_output_config_schema_is_followed_as_chat_follows_it(
    anthropic: Anthropic, client: OpenAI
) -> None:
    schema = closed_object(
        city={"type": "string", "maxLength": 12},
        rank={"type": "integer", "minimum": 1, "maximum": 9},
    )
    question = [{"role": "user", "content": "Name a big city as JSON."}]
    kwargs = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": question,
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    }

    def streamed() -> str:
        with anthropic.messages.stream(**kwargs) as stream:
            return "".join(stream.text_stream)

    message, streamed_text, chat = parallel(
        lambda: anthropic.messages.create(**kwargs),
        streamed,
        lambda: _greedy_chat(
            client,
            question,
            40,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        ),
    )
    assert message.stop_reason == "end_turn"
    ((_, text),) = _blocks(message.content)
    jsonschema.validate(json.loads(text), schema)
    assert text == streamed_text == chat.choices[0].message.content


def test_a_prefilled_assistant_turn_is_continued(base_url: str, anthropic: Anthropic) -> None:
    """A last assistant turn is a prefill: "the response content will continue
    immediately from the content in that message" (Anthropic's Messages reference). The
    reference: a plain completion of the rendered conversation, cut before the end of the
    assistant turn."""
    prefill = "The capital of France is the city of"
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    rendered = httpx.post(
        f"{base_url}/tokenize",
        json={"messages": messages, "add_generation_prompt": False, "return_token_strs": True},
        timeout=60,
    ).json()
    assert rendered["token_strs"][-2:] == ["<|im_end|>", "Ċ"]  # the turn's end, then "\n"
    prompt = rendered["tokens"][:-2]
    completion = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=60,
    ).json()
    message = anthropic.messages.create(model=MODEL, max_tokens=8, messages=messages, **GREEDY)
    assert _blocks(message.content) == [("text", completion["choices"][0]["text"])]
    assert _prompt_tokens(message.usage) == len(prompt)


IMAGE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("missing max_tokens", {"max_tokens": None}, "max_tokens"),
    (
        "image block",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": IMAGE}]}]},
        "image",
    ),
    ("temperature above 1", {"temperature": 1.5}, "temperature"),
    ("streamed, temperature above 1", {"temperature": 1.5, "stream": True}, "temperature"),
    (
        "named tool_choice without a name",
        {"tools": TOOLS, "tool_choice": {"type": "tool"}},
        "tool_choice",
    ),
    ("no messages", {"messages": []}, "messages"),
    (
        "tool_use in a user turn",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
                }
            ]
        },
        "tool_use",
    ),
    ("thinking of no known type", {"thinking": {"type": "sometimes"}}, "thinking"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web"}]}, "server tools"),
    (
        "tool blocks without tools",
        {
            "messages": [
                *QUESTION,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}],
                },
            ]
        },
        "tools",
    ),
    (
        "output_config schema that is no object",
        {"output_config": {"format": {"type": "json_schema", "schema": 5}}},
        "output_config",
    ),
    (
        "input_schema the grammar cannot enforce",
        {
            "tools": [
                {
                    "name": "f",
                    "input_schema": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                }
            ],
            "tool_choice": {"type": "any"},
        },
        "tools[0].input_schema",
    ),
]


@pytest.mark.parametrize(("fields", "named"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_a_bad_request_gets_anthropics_error_body(
    base_url: str, fields: dict[str, Any], named: str
) -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": QUESTION, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    response = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error["error"]["message"]},
    }
    message = error["error"]["message"]
    assert named in message
    # The checks are the chat path's; the message names the Messages API's fields.
    assert "response_format" not in message and "function.parameters" not in message


def test_null_fields_mean_their_defaults(base_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "temperature": 0}
    nulls = {"stream": None, "tools": None, "system": None, "stop_sequences": None}
    plain, with_nulls = (
        httpx.post(f"{base_url}/v1/messages", json=b, timeout=60) for b in (body, {**body, **nulls})
    )
    assert plain.status_code == with_nulls.status_code == 200, with_nulls.text
    assert plain.json()["content"] == with_nulls.json()["content"]


def test_an_unknown_model_is_not_found_in_anthropics_shape(base_url: str) -> None:
    body = {"model": "claude-nonexistent", "max_tokens": 5, "messages": QUESTION}
    response = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 404, response.text
    error = response.json()
    assert error == {
        "type": "error",
        "error": {"type": "not_found_error", "message": error["error"]["message"]},
    }
    assert "claude-nonexistent" in error["error"]["message"]


def test_the_sdk_raises_the_error_it_was_sent(anthropic: Anthropic) -> None:
    with pytest.raises(BadRequestError) as raised:
        anthropic.messages.create(
            model=MODEL, max_tokens=5, messages=QUESTION, extra_body={"temperature": 1.5}
        )
    assert raised.value.status_code == 400
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in raised.value.body["error"]["message"]


def test_count_tokens_counts_what_a_message_would_use(anthropic: Anthropic) -> None:
    system = "You are terse."
    plain, with_tools = parallel(
        lambda: anthropic.messages.create(
            model=MODEL, max_tokens=2, system=system, messages=QUESTION, **GREEDY
        ),
        lambda: anthropic.messages.create(
            model=MODEL, max_tokens=2, messages=WEATHER_QUESTION, tools=TOOLS, **GREEDY
        ),
    )
    counted = anthropic.messages.count_tokens(model=MODEL, system=system, messages=QUESTION)
    assert counted.input_tokens == _prompt_tokens(plain.usage)
    counted = anthropic.messages.count_tokens(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS)
    assert counted.input_tokens == _prompt_tokens(with_tools.usage)
    # Bad input is refused as /v1/messages refuses it, in Anthropic's shape.
    with pytest.raises(BadRequestError) as raised:
        anthropic.messages.count_tokens(model=MODEL, messages=[])
    assert raised.value.body["type"] == "error"
