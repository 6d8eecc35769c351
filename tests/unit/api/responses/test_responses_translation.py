"""``/v1/responses`` as Codex CLI sends it: the translation into a chat request
(`ResponsesRequest.to_chat`) and the response written back (`ResponsesFormat`).

The fixture ``tests/fixtures/codex/responses_request.json`` is the first request of
``codex exec "say hi"`` (Codex CLI 0.171, a custom provider with ``wire_api =
"responses"``), recorded by a proxy in front of a trio_llm server; its ids are zeroed.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.responses import Response

from trio_llm.api.chat.planner import Plan
from trio_llm.api.http.errors import APIError
from trio_llm.api.responses.format import ResponsesFormat
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.api.tools.parsers import make_parser
from trio_llm.text.output import TextDelta

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "codex"


def codex_body() -> dict[str, Any]:
    """A fresh copy of Codex's recorded request body."""
    return json.loads((FIXTURES / "responses_request.json").read_text())


def function(name: str, **properties: Any) -> dict[str, Any]:
    """A Responses function tool whose parameters are ``properties`` (all strings)."""
    parameters = {
        "type": "object",
        "properties": {key: {"type": "string"} for key in properties},
        "required": list(properties),
    }
    return {"type": "function", "name": name, "description": name, "parameters": parameters}


def namespace(name: str, *tools: dict[str, Any]) -> dict[str, Any]:
    return {"type": "namespace", "name": name, "description": f"{name} tools", "tools": list(tools)}


def chat_tool_names(request: ResponsesRequest) -> list[str]:
    chat = request.to_chat()
    return [tool.function.name for tool in chat.tools or []]


def render(request: ResponsesRequest, text: str, *, tools: bool = True) -> dict[str, Any]:
    """The whole response written for a model output ``text`` (hermes tool calls)."""
    parser = (lambda: make_parser("hermes")) if tools else None
    form = ResponsesFormat(None, parser, request=request)  # type: ignore[arg-type]
    plan = Plan(format=form, model="m", response_id="resp_1", created=1, prompt_lengths=[7])
    choice = SimpleNamespace(
        index=0,
        text=text,
        finish_reason="stop",
        stop_reason=None,
        num_output_tokens=5,
        num_cached_tokens=0,
        all_logprobs=[],
    )
    return form.response(plan, [choice])  # type: ignore[list-item]


def stream(request: ResponsesRequest, pieces: list[str]) -> list[dict[str, Any]]:
    """The events of a stream whose model output comes in ``pieces``."""
    form = ResponsesFormat(None, lambda: make_parser("hermes"), request=request)  # type: ignore[arg-type]
    plan = Plan(format=form, model="m", response_id="resp_1", created=1, prompt_lengths=[7])
    choice = SimpleNamespace(
        index=0,
        text="",
        finish_reason=None,
        stop_reason=None,
        num_output_tokens=0,
        num_cached_tokens=0,
    )
    events = form.stream_start(plan, [choice])  # type: ignore[list-item]
    for k, text in enumerate(pieces):
        last = k == len(pieces) - 1
        choice.text += text
        choice.num_output_tokens += 1
        if last:
            choice.finish_reason = "stop"
        piece = TextDelta(text, finish_reason="stop" if last else None)
        events += form.stream_piece(plan, choice, piece)  # type: ignore[arg-type]
    return [data for _, data in events]


# ------------------------------------------------------------------ Codex's request


def test_codex_request_translates_with_its_namespace_functions_and_without_web_search():
    body = codex_body()
    kinds = [tool["type"] for tool in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds  # the shape this test is about
    request = ResponsesRequest.model_validate(body)
    names = chat_tool_names(request)
    expected = []
    for tool in body["tools"]:
        if tool["type"] == "function":
            expected.append(tool["name"])
        elif tool["type"] == "namespace":
            expected += [member["name"] for member in tool["tools"]]
    assert sorted(names) == sorted(expected)
    assert "close_agent" in names  # a function of the multi_agent_v1 namespace


def test_codex_request_fields_are_accepted_and_echoed():
    body = codex_body()
    request = ResponsesRequest.model_validate(body)
    chat = request.to_chat()
    assert chat.stream is True
    response = render(request, "hi")
    assert response["reasoning"] == {"effort": None, "summary": "auto"}
    assert response["prompt_cache_key"] == body["prompt_cache_key"]
    assert response["store"] is False
    assert response["tools"] == body["tools"]  # hosted and namespace tools as sent
    assert response["tool_choice"] == "auto"
    Response.model_validate(response, strict=True)


def test_codex_developer_messages_reach_the_prompt():
    body = codex_body()
    chat = ResponsesRequest.model_validate(body).to_chat()
    roles = [message.role for message in chat.messages]
    assert roles == [item["role"] for item in body["input"]]
    assert chat.messages[-1].content == "say hi"


# ------------------------------------------------------------------ namespaces


def test_a_namespaced_call_comes_back_with_its_namespace():
    body = codex_body()
    request = ResponsesRequest.model_validate(body)
    request.to_chat()
    text = '<tool_call>{"name": "close_agent", "arguments": {"target": "a1"}}</tool_call>'
    response = render(request, text)
    (call,) = response["output"]
    assert call["type"] == "function_call"
    assert call["name"] == "close_agent"
    assert call["namespace"] == "multi_agent_v1"
    assert json.loads(call["arguments"]) == {"target": "a1"}
    Response.model_validate(response, strict=True)


def test_a_plain_function_call_has_no_namespace():
    request = ResponsesRequest.model_validate(codex_body())
    request.to_chat()
    text = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "ls"}}</tool_call>'
    (call,) = render(request, text)["output"]
    assert call["name"] == "exec_command"
    assert "namespace" not in call


def test_a_namespaced_call_streams_with_its_namespace():
    request = ResponsesRequest.model_validate(codex_body())
    request.to_chat()
    pieces = ['<tool_call>{"name": "close_agent", ', '"arguments": {"target": "a1"}}']
    pieces.append("</tool_call>")
    events = stream(request, pieces)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["namespace"] for e in added + done] == ["multi_agent_v1"] * 2
    assert [e["item"]["name"] for e in added + done] == ["close_agent"] * 2
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert completed["response"]["output"][0]["namespace"] == "multi_agent_v1"
    assert completed["response"]["completed_at"] is not None
    Response.model_validate(completed["response"], strict=True)


def test_functions_of_one_name_in_two_namespaces_are_told_apart():
    tools = [
        function("search", q="q"),
        namespace("mcp__fs__", function("search", path="p")),
        namespace("docs", function("search", topic="t"), function("fetch", url="u")),
    ]
    request = ResponsesRequest.model_validate({"input": "x", "tools": tools})
    assert chat_tool_names(request) == ["search", "mcp__fs__search", "docs__search", "fetch"]
    text = '<tool_call>{"name": "mcp__fs__search", "arguments": {"path": "/"}}</tool_call>'
    (call,) = render(request, text)["output"]
    assert (call["namespace"], call["name"]) == ("mcp__fs__", "search")
    (call,) = render(request, text.replace("mcp__fs__search", "search"))["output"]
    assert call["name"] == "search" and "namespace" not in call
    (call,) = render(request, text.replace("mcp__fs__search", "fetch"))["output"]
    assert (call["namespace"], call["name"]) == ("docs", "fetch")


def test_a_namespaced_call_in_the_input_gets_the_name_the_model_knows():
    tools = [function("search", q="q"), namespace("docs", function("search", topic="t"))]
    body = {
        "tools": tools,
        "input": [
            {"role": "user", "content": "find"},
            {
                "type": "function_call",
                "call_id": "c1",
                "namespace": "docs",
                "name": "search",
                "arguments": '{"topic": "x"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "found"},
        ],
    }
    chat = ResponsesRequest.model_validate(body).to_chat()
    (call,) = chat.messages[1].tool_calls
    assert call.function.name == "docs__search"


def test_a_named_tool_choice_of_a_namespaced_function():
    tools = [namespace("multi_agent_v1", function("close_agent", target="t"))]
    choice = {"type": "function", "name": "close_agent"}
    body = {"input": "x", "tools": tools, "tool_choice": choice}
    chat = ResponsesRequest.model_validate(body).to_chat()
    assert chat.tool_choice.function.name == "close_agent"


def test_an_error_in_a_namespaced_function_names_its_place():
    bad = {"type": "function", "name": "f", "parameters": "not an object"}
    tools = [function("a", x="x"), namespace("ns", function("b", y="y"), bad)]
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate({"input": "x", "tools": tools}).to_chat()
    assert raised.value.status == 400
    assert raised.value.param == "tools"
    assert "tools[1].tools[1]" in raised.value.message


def test_a_chat_path_error_in_a_namespaced_function_names_its_place():
    array = {"type": "function", "name": "b", "parameters": {"type": "array"}}
    tools = [{"type": "web_search"}, function("a", x="x"), namespace("ns", array)]
    request = ResponsesRequest.model_validate({"input": "x", "tools": tools})
    with pytest.raises(APIError) as raised:
        request.to_chat().structured_output()
    _, message = request.api_names(raised.value.param, raised.value.message)
    assert message.startswith("tools[2].tools[0].parameters (b) must be")


def test_two_tools_the_model_would_know_by_one_name_are_a_400():
    tools = [function("a__b"), namespace("a", function("b")), function("b")]
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate({"input": "x", "tools": tools}).to_chat()
    assert raised.value.status == 400 and raised.value.param == "tools"
    assert "'a__b'" in raised.value.message


# ------------------------------------------------------------------ hosted tools


@pytest.mark.parametrize(
    "hosted",
    [
        {"type": "web_search", "external_web_access": False},
        {"type": "web_search_preview"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "image_generation"},
        {"type": "computer_use_preview", "display_width": 1, "display_height": 1},
        {"type": "mcp", "server_label": "s", "server_url": "https://example.invalid"},
        {"type": "local_shell"},
        {"type": "custom", "name": "apply_patch", "description": "patch"},
    ],
)
def test_a_hosted_tool_is_accepted_not_offered_and_echoed(hosted):
    tools = [function("get_weather", city="c"), hosted]
    request = ResponsesRequest.model_validate({"input": "x", "tools": tools})
    assert chat_tool_names(request) == ["get_weather"]
    assert render(request, "hi")["tools"] == tools


def test_only_hosted_tools_with_auto_is_plain_text():
    body = {"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"}
    chat = ResponsesRequest.model_validate(body).to_chat()
    assert not chat.tools and chat.tool_choice is None


def test_only_hosted_tools_with_required_is_a_400_naming_tool_choice():
    body = {"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate(body).to_chat()
    assert raised.value.param == "tool_choice"
    assert "web_search" in raised.value.message


def test_only_empty_namespaces_with_required_is_a_400_saying_so():
    tools = [{"type": "namespace", "name": "a", "description": "", "tools": []}]
    body = {"input": "x", "tools": tools, "tool_choice": "required"}
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate(body).to_chat()
    assert raised.value.param == "tool_choice"
    assert "namespaces given hold no functions" in raised.value.message


def test_an_unknown_tool_type_is_a_400_naming_what_is_accepted():
    body = {"input": "x", "tools": [{"type": "teleport"}]}
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate(body).to_chat()
    assert raised.value.param == "tools" and "teleport" in raised.value.message
    assert "web_search" in raised.value.message  # the accepted hosted types are listed


def test_a_tool_type_that_is_no_string_is_a_400_not_a_crash():
    body = {"input": "x", "tools": [{"type": ["web_search"]}]}
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate(body).to_chat()
    assert raised.value.status == 400 and raised.value.param == "tools"
    assert "unknown tool type ['web_search']" in raised.value.message


def test_a_namespace_member_of_an_unknown_type_is_a_400_naming_its_place():
    body = {"input": "x", "tools": [namespace("ns", function("a"), {"type": "teleport"})]}
    with pytest.raises(APIError) as raised:
        ResponsesRequest.model_validate(body).to_chat()
    assert raised.value.param == "tools" and "tools[0].tools[1]" in raised.value.message


def test_hosted_tools_are_logged_once_per_connection(caplog):
    body = {"input": "x", "tools": [{"type": "web_search"}, {"type": "file_search"}]}

    def send(client: tuple[str, int]) -> None:
        request = ResponsesRequest.model_validate(copy.deepcopy(body))
        request.bind_connection(client)
        request.to_chat()

    with caplog.at_level(logging.WARNING, logger="trio_llm.api.responses.request"):
        send(("10.0.0.1", 40001))
        send(("10.0.0.1", 40001))
        send(("10.0.0.1", 40002))
    lines = [r.getMessage() for r in caplog.records if "not offered" in r.getMessage()]
    assert len(lines) == 2
    assert all("web_search, file_search" in line for line in lines)
    assert "10.0.0.1:40001" in lines[0] and "10.0.0.1:40002" in lines[1]


# ------------------------------------------------------------------ other fields, echo


def test_agent_fields_are_accepted_and_echoed():
    body = {
        "input": "x",
        "reasoning": {"effort": "high", "summary": "detailed"},
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "prompt_cache_key": "k",
        "client_metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "user-1",
        "truncation": "auto",
        "max_tool_calls": 3,
        "text": {"verbosity": "low"},
    }
    request = ResponsesRequest.model_validate(body)
    request.to_chat()
    assert request.reasoning is not None and request.reasoning.effort == "high"
    response = render(request, "hi", tools=False)
    assert response["reasoning"] == {"effort": "high", "summary": "detailed"}
    assert response["prompt_cache_key"] == "k"
    assert response["safety_identifier"] == "user-1"
    assert response["service_tier"] == "default"
    assert response["max_tool_calls"] == 3
    assert response["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert response["truncation"] == "disabled"  # nothing is truncated here
    Response.model_validate(response, strict=True)


def test_an_unknown_reasoning_effort_is_refused():
    with pytest.raises(ValueError, match="effort"):
        ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "extreme"}})


def test_tool_choice_echo_is_openais_default_auto():
    request = ResponsesRequest.model_validate({"input": "x"})
    request.to_chat()
    response = render(request, "hi", tools=False)
    assert response["tool_choice"] == "auto"
    assert response["tools"] == []
    assert response["completed_at"] is not None and response["completed_at"] >= 1
    assert response["background"] is False
    Response.model_validate(response, strict=True)
