"""``/v1/responses`` as Codex CLI sends it, against the shared server: the recorded
request of ``codex exec "say hi"`` (``tests/fixtures/codex/responses_request.json``:
function tools, a ``namespace`` tool, the hosted ``web_search``, ``reasoning``,
``include``, ``prompt_cache_key``, ``client_metadata``, ``store: false``), with its
developer messages and descriptions cut (5,400 prompt tokens become 2,500: it fits
SmolLM2's 8,192-token context, and the prefill is short), is answered 200 and streamed
as Codex reads it; a forced call of the namespace's function comes back with the
``namespace`` and the function's own name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from openai.types.responses import Response

from tests.e2e.conftest import MODEL
from tests.support.sse import names_and_data

FIXTURE = Path(__file__).parent.parent / "fixtures" / "codex" / "responses_request.json"
HEADERS_FIXTURE = FIXTURE.with_name("responses_headers.json")


def _cut_descriptions(value: Any) -> Any:
    """``value`` with every ``description`` string cut to 40 characters."""
    if isinstance(value, dict):
        return {
            key: item[:40]
            if key == "description" and isinstance(item, str)
            else _cut_descriptions(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_cut_descriptions(item) for item in value]
    return value


def codex_request(**changes: Any) -> dict[str, Any]:
    """Codex's recorded request for this server: the model's name, the developer
    messages cut to 400 characters each, the tools' descriptions to 40, a short greedy
    output, then ``changes``."""
    body = json.loads(FIXTURE.read_text())
    body["model"] = MODEL
    body["tools"] = _cut_descriptions(body["tools"])
    for item in body["input"]:
        if item.get("role") == "developer":
            for part in item["content"]:
                part["text"] = part["text"][:400]
    body["max_output_tokens"] = 24
    body["temperature"] = 0
    body.update(changes)
    return body


def stream_events(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST ``body`` with Codex's headers; the stream's events (asserting a 200 and
    that each event's name is its data's type)."""
    headers = json.loads(HEADERS_FIXTURE.read_text())
    headers["authorization"] = "Bearer dummy"
    with httpx.stream(
        "POST", f"{base_url}/v1/responses", json=body, headers=headers, timeout=300
    ) as response:
        if response.status_code != 200:
            response.read()
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        names, events = names_and_data(response.iter_lines())
    assert names == [event["type"] for event in events]
    return events


def test_codex_request_is_streamed(base_url: str) -> None:
    body = codex_request()
    assert {tool["type"] for tool in body["tools"]} == {"function", "namespace", "web_search"}
    events = stream_events(base_url, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    response = events[-1]["response"]
    Response.model_validate(response)
    assert response["tools"] == body["tools"]
    assert response["tool_choice"] == "auto"
    assert response["reasoning"]["summary"] == "auto"
    assert response["prompt_cache_key"] == body["prompt_cache_key"]
    assert response["store"] is False
    assert response["usage"]["input_tokens"] > 2000  # the tools and instructions were shown


def test_a_forced_call_of_a_namespaced_function_names_its_namespace(base_url: str) -> None:
    choice = {"type": "function", "name": "close_agent"}
    body = codex_request(tool_choice=choice, max_output_tokens=64)
    events = stream_events(base_url, body)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added and len(added) == len(done)
    for item in added + done:
        assert item["type"] == "function_call"
        assert (item["namespace"], item["name"]) == ("multi_agent_v1", "close_agent")
    final = events[-1]["response"]
    Response.model_validate(final)
    assert [(i["namespace"], i["name"]) for i in final["output"]] == [
        ("multi_agent_v1", "close_agent")
    ] * len(final["output"])
    if final["status"] == "completed":
        arguments = json.loads(final["output"][0]["arguments"])
        assert isinstance(arguments["target"], str)
