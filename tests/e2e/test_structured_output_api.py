"""Structured output over HTTP against the shared server (SmolLM2), with the official
openai SDK where it has a helper: every finished output validates."""

from __future__ import annotations

import json
import re
from enum import StrEnum

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL


class Color(StrEnum):
    RED = "red"
    GREEN = "green"


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Shape(BaseModel):
    name: str = Field(max_length=16)
    color: Color
    corners: list[Point] = Field(max_length=3)
    note: str | None = Field(max_length=12)


MESSAGES = [{"role": "user", "content": "Describe a small red triangle as JSON."}]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sdk_parses_a_pydantic_model(client: OpenAI, seed: int) -> None:
    sampled = {"max_tokens": 300, "temperature": 1.0, "seed": seed}
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Shape, **sampled
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Shape)


def test_a_streamed_schema_output_validates(base_url: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["cm", "m"]}},
        "required": ["answer", "unit"],
        "additionalProperties": False,
    }
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 60,
        # Greedy: an unseeded sample may spend the 60 tokens on whitespace the schema allows.
        "temperature": 0,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    text, finish = "", None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, r"[A-Z][a-z]{2,8}"),
        ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
        ({"structured_outputs": {"choice": ["Paris", "Rome"]}}, r"Paris|Rome"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"response_format": {"type": "json_object"}}, None),
    ],
)
def test_completions_take_vllms_fields(base_url: str, fields: dict, check: str | None) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 80, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if check is not None:
        assert choice["finish_reason"] == "stop" and re.fullmatch(check, choice["text"])
    elif choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)


@pytest.mark.parametrize(
    ("fields", "param", "reason"),
    [
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs", "not"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(
    base_url: str, fields: dict, param: str, reason: str
) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error
