"""LangChain's ``ChatOpenAI`` against the shared server (SmolLM2): structured output
through ``with_structured_output``, enforced by the server. Skipped where
langchain-openai is not installed (it is in the dev extras)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=40)


MESSAGES = [("user", "Describe Paris as JSON.")]


@pytest.fixture
def chat(base_url: str, monkeypatch: pytest.MonkeyPatch):
    """A ``ChatOpenAI`` for the server (seeded, no retries, no LangSmith tracing: the
    test reaches nothing but the server)."""
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        monkeypatch.delenv(name, raising=False)
    return langchain_openai.ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        model=MODEL,
        temperature=1.0,
        seed=0,
        max_tokens=200,
        max_retries=0,
    )


def _structured(chat, schema: Any, method: str) -> dict[str, Any]:
    """``chat.with_structured_output(schema, method=method, include_raw=True)``'s answer to
    `MESSAGES`, asserted to have parsed."""
    result = chat.with_structured_output(schema, method=method, include_raw=True).invoke(MESSAGES)
    assert result["parsing_error"] is None
    return result


def test_json_schema_method_returns_a_valid_pydantic_object(chat) -> None:
    result = _structured(chat, City, "json_schema")
    assert result["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(result["parsed"], City)


def test_json_mode_returns_a_json_object(chat) -> None:
    """``json_mode`` sends ``response_format: {"type": "json_object"}`` and no schema: the
    server guarantees an object, not its keys, so it is parsed as a dict."""
    result = _structured(chat, None, "json_mode")
    assert result["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(result["parsed"], dict)


def test_function_calling_method_returns_a_valid_pydantic_object(chat) -> None:
    """``function_calling`` binds the model as a tool and forces it (a named tool_choice)."""
    result = _structured(chat, City, "function_calling")
    assert isinstance(result["parsed"], City)


def _get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 C and light rain in {city}"


def test_bind_tools_round_trip_streamed_and_not(chat) -> None:
    """``bind_tools`` with tool_choice "any" (sent as "required"): a valid call, the same
    one streamed, then the tool's result back and a text answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(_get_weather)
    greedy = chat.bind(temperature=0)
    # strict: the schema gets additionalProperties false (else a small model adds keys
    # until max_tokens)
    forced = greedy.bind_tools([weather], tool_choice="any", strict=True, parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    message = forced.invoke([question])
    assert message.tool_calls
    assert all(call["name"] == "_get_weather" for call in message.tool_calls)
    assert all(isinstance(call["args"].get("city"), str) for call in message.tool_calls)
    streamed = None
    for chunk in forced.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in message.tool_calls
    ]
    history = [question, message]
    for call in message.tool_calls:
        history.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = greedy.bind_tools([weather], tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and final.content
    assert not final.tool_calls
