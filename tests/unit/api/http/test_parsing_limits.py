"""`check_limits`: the counts checked on the raw JSON of every endpoint's body, each
refused with a 400 naming the endpoint's own field; and how deep JSON may nest (in the
body, in JSON text inside it, past what Python's parser reaches)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_llm.api.anthropic.request import MessagesRequest
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.embeddings import EmbeddingRequest
from trio_llm.api.http.errors import APIError
from trio_llm.api.http.parsing import (
    MAX_JSON_DEPTH,
    CountedFields,
    JSONTooDeepError,
    check_limits,
    json_depth_exceeds,
    load_json,
    parse_json,
    validate,
)
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.server_config import RequestLimits
from trio_llm.text.chat_template import TemplateError, render_messages

LIMITS = RequestLimits(max_chat_messages=3, max_stop_strings=2)
TURN = {"role": "user", "content": "hi"}


def _param(data: dict[str, Any], model: type | None = None) -> str | None:
    """The field a refusal names, or "ok" when the body passes (counting the fields
    ``model`` declares; none without one)."""
    fields = getattr(model, "COUNTED_FIELDS", CountedFields())
    try:
        check_limits(data, LIMITS, max_model_len=4096, vocab_size=1000, fields=fields)
    except APIError as exc:
        assert exc.status == 400
        return exc.param
    return "ok"


@pytest.mark.parametrize(
    ("model", "data", "expected"),
    [
        (ChatCompletionRequest, {"messages": [TURN] * 3}, "ok"),
        (ChatCompletionRequest, {"messages": [TURN] * 4}, "messages"),
        (MessagesRequest, {"messages": [TURN] * 4}, "messages"),
        (ResponsesRequest, {"input": [TURN] * 4}, "input"),  # Responses items
        (ResponsesRequest, {"input": "one text"}, "ok"),
        # Embeddings: token ids of one input, or texts, are not messages.
        (EmbeddingRequest, {"input": [101, 7592, 2088, 102]}, "ok"),
        (EmbeddingRequest, {"input": ["a", "b", "c", "d"]}, "ok"),
        (ChatCompletionRequest, {"stop": ["a", "b", "c"]}, "stop"),
        (MessagesRequest, {"stop_sequences": ["a", "b", "c"]}, "stop_sequences"),
        (MessagesRequest, {"stop_sequences": ["x" * 300]}, "stop_sequences"),
    ],
)
def test_each_count_is_refused_by_its_own_name(
    model: type, data: dict[str, Any], expected: str
) -> None:
    assert _param(data, model) == expected


# ------------------------------------------------------------------ nesting depth


def _nested(depth: int) -> Any:
    """``depth`` arrays within one another (a scalar for 0)."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        (0, 0),
        ("text", 0),
        ([], 1),
        ({"a": 1, "b": [1, 2]}, 2),
        ([1, {"a": [{"b": {}}]}], 5),
        (list(range(1000)), 1),
        (_nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH),
        (_nested(100_000), 100_000),  # far past Python's recursion limit
    ],
)
def test_json_depth_counts_levels_of_arrays_and_objects(value: Any, depth: int) -> None:
    assert not json_depth_exceeds(value, depth)
    assert json_depth_exceeds(value, depth - 1) == (depth > 0)


@pytest.mark.parametrize("name", ["messages", "tools", "prompt", "response_format", "unknown"])
def test_a_field_nested_past_the_limit_is_refused_by_name(name: str) -> None:
    # The body is the first level: a field may hold MAX_JSON_DEPTH - 1 more.
    assert _param({name: _nested(MAX_JSON_DEPTH - 1)}) == "ok"
    assert _param({name: _nested(MAX_JSON_DEPTH)}) == name


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ('{"model": "m", "messages": ' + "[" * 5000 + "]" * 5000 + "}", "messages"),
        ('{"a": 1, "b": {"c": ' + "[" * 5000 + "]" * 5000 + "}}", "b"),
        ("[" * 5000 + "]" * 5000, None),
    ],
)
def test_json_too_deep_to_parse_is_refused_naming_the_field(text: str, param: str | None) -> None:
    with pytest.raises(APIError) as refused:
        parse_json(text.encode())
    assert (refused.value.status, refused.value.param) == (400, param)
    assert f"nested more than {MAX_JSON_DEPTH} levels" in refused.value.message


def test_json_too_deep_to_parse_keeps_the_members_before_it() -> None:
    text = '{"type": "chat", "id": "x", "messages": ' + "[" * 5000 + "]" * 5000 + "}"
    with pytest.raises(JSONTooDeepError) as raised:
        load_json(text)
    assert (raised.value.members, raised.value.field) == ({"type": "chat", "id": "x"}, "messages")
    with pytest.raises(APIError) as invalid:
        parse_json(b'{"a": [1, 2}')
    assert invalid.value.message == "the request body is not valid JSON"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 5000])
def test_tool_call_arguments_nested_too_deep_are_refused(depth: int) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    call["function"]["arguments"] = "[" * depth + "]" * depth
    body = {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    }
    with pytest.raises(APIError) as refused:
        validate(ChatCompletionRequest, body, LIMITS, max_model_len=4096, vocab_size=1000)
    assert refused.value.param == "messages"
    assert "nested more than" in refused.value.message
    call["function"]["arguments"] = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    request = validate(ChatCompletionRequest, body, LIMITS, max_model_len=4096, vocab_size=1000)
    arguments = request.template_messages()[1]["tool_calls"][0]["function"]["arguments"]
    assert not json_depth_exceeds(arguments) and json_depth_exceeds(arguments, MAX_JSON_DEPTH - 1)


def test_a_template_that_recurses_too_deeply_is_a_template_error() -> None:
    source = (
        "{% macro walk(v) %}{% if v is sequence and v is not string %}"
        "[{% for x in v %}{{ walk(x) }}{% endfor %}]{% else %}{{ v }}{% endif %}{% endmacro %}"
        "{% for m in messages %}{{ walk(m.content) }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="nests too deeply"):
        render_messages(source, [{"role": "user", "content": _nested(2000)}])
