"""LangChain's ``ChatOpenAI`` against the shared server (SmolLM2): structured output
through ``with_structured_output``, enforced by the server. Skipped where
langchain-openai is not installed (it is in the dev extras)."""

from __future__ import annotations

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


def test_json_schema_method_returns_a_valid_pydantic_object(chat) -> None:
    structured = chat.with_structured_output(City, method="json_schema", include_raw=True)
    result = structured.invoke(MESSAGES)
    assert result["parsing_error"] is None
    assert result["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(result["parsed"], City)


def test_json_mode_returns_a_json_object(chat) -> None:
    """``json_mode`` sends ``response_format: {"type": "json_object"}`` and no schema: the
    server guarantees an object, not its keys, so it is parsed as a dict."""
    structured = chat.with_structured_output(None, method="json_mode", include_raw=True)
    result = structured.invoke(MESSAGES)
    assert result["parsing_error"] is None
    assert result["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(result["parsed"], dict)
