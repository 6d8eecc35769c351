"""Claude Code's requests (tests/fixtures/claude_code, captured from Claude Code 2.1.197)
against the shared server, with the headers it sends: counted whatever their length,
served with 200s, Anthropic's usage fields in ``message_start``, and a ``request-id`` on
every response. Its first request is about 22,000 tokens here, over SmolLM2's 8,192, so
the served requests are trimmed (system prompt, tool list, descriptions) and ask for few
output tokens; every field and block type Claude Code sends stays."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import MODEL

FIXTURES = Path(__file__).parent.parent / "fixtures" / "claude_code"

#: The tools the trimmed requests keep (TaskCreate has a record field with propertyNames).
KEPT_TOOLS = ("Bash", "Read", "TaskCreate")


def captured(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers (Claude Code's own, the API key a dummy) and body of a capture."""
    record = json.loads((FIXTURES / f"{name}.json").read_text())
    return record["headers"], {**record["body"], "model": MODEL}


def trimmed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` cut down to fit SmolLM2's context: shorter texts, three tools, few
    output tokens (the clamp of Claude Code's max_tokens: 32000 is another change)."""
    body = copy.deepcopy(body)
    for block in body["system"]:
        block["text"] = block["text"][:400]
    body["tools"] = [tool for tool in body["tools"] if tool["name"] in KEPT_TOOLS]
    for tool in body["tools"]:
        tool["description"] = tool["description"][:200]
    for turn in body["messages"]:
        if isinstance(turn["content"], str):
            turn["content"] = turn["content"][:400]
    body["max_tokens"] = 8
    body["temperature"] = 0
    return body


def parse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A Messages stream's ``(event name, data)`` pairs, in order."""
    events = []
    for chunk in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in chunk.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def check_request_id(response: httpx.Response) -> None:
    request_id = response.headers.get("request-id", "")
    assert request_id.startswith("req_") and len(request_id) > 10, response.headers


def count(base_url: str, headers: dict[str, str], body: dict[str, Any]) -> int:
    response = httpx.post(
        f"{base_url}/v1/messages/count_tokens?beta=true", headers=headers, json=body, timeout=120
    )
    assert response.status_code == 200, response.text
    check_request_id(response)
    return response.json()["input_tokens"]


def test_count_tokens_counts_claude_codes_whole_first_request(base_url: str) -> None:
    """Over the context: counted, not refused (a client counts to learn just that)."""
    headers, body = captured("first_request")
    assert count(base_url, headers, body) > 8192


def test_claude_codes_first_request_trimmed_streams_with_usage(base_url: str) -> None:
    headers, body = captured("first_request")
    body = trimmed(body)
    assert body["messages"][-1]["role"] == "system"  # Claude Code's system turn stays
    with httpx.stream(
        "POST", f"{base_url}/v1/messages?beta=true", headers=headers, json=body, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        check_request_id(response)
        events = parse_events(response.read().decode())
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    usage = events[0][1]["message"]["usage"]
    # Anthropic's usage: the prompt is input_tokens plus the tokens read from the cache.
    assert set(usage) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt == count(base_url, headers, body)
    assert usage["cache_creation_input_tokens"] == 0 and usage["output_tokens"] == 0
    delta = next(data for name, data in events if name == "message_delta")
    assert 1 <= delta["usage"]["output_tokens"] <= 8


def without_thinking(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without thinking blocks, ``thinking`` or ``output_config.effort``."""
    body = copy.deepcopy(body)
    for name in ("thinking", "output_config", "context_management"):
        body.pop(name, None)
    for turn in body["messages"]:
        if isinstance(turn["content"], list):
            turn["content"] = [b for b in turn["content"] if b["type"] != "thinking"]
    return body


def test_claude_codes_tool_result_request_trimmed_is_served(base_url: str) -> None:
    """The second request of a turn: the first answer's thinking block and Read call sent
    back, and the tool's result. On a model without reasoning the thinking fields and
    blocks change nothing: the prompt is the one without them."""
    headers, body = captured("tool_result_request")
    body = {**trimmed(body), "stream": False}
    response = httpx.post(
        f"{base_url}/v1/messages?beta=true", headers=headers, json=body, timeout=120
    )
    assert response.status_code == 200, response.text
    check_request_id(response)
    message = response.json()
    assert message["type"] == "message" and message["stop_reason"] in ("max_tokens", "end_turn")
    usage = message["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt == count(base_url, headers, without_thinking(body))
    assert usage["cache_creation_input_tokens"] == 0 and "cache_read_input_tokens" in usage


def test_an_anthropic_error_carries_a_request_id(base_url: str) -> None:
    headers, body = captured("title_request")
    response = httpx.post(
        f"{base_url}/v1/messages", headers=headers, json={**body, "model": "nope"}, timeout=60
    )
    assert response.status_code == 404
    assert response.json()["type"] == "error"
    check_request_id(response)


def test_claude_codes_preflight_head_is_answered(base_url: str) -> None:
    """Claude Code's first call is ``HEAD /`` (answered 405 before: HEAD is GET's)."""
    response = httpx.head(f"{base_url}/", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
