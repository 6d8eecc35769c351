"""Issue 31 against the real server (8,192-token context): a prompt over the context is
refused in each client's own terms, and a prompt prefix served from the prefix cache is
reported in the usage of the request that reused it. The wording per route, the clamp
and the strict policy are tested in-process: tests/unit/api/chat/test_context_errors.py."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.e2e.conftest import MODEL

LONG = "word " * 9000  # about 9,000 tokens, past the 8,192-token context
HEAD = "This model's maximum context length is 8192 tokens. However, your request has"


@pytest.fixture
def http(base_url: str):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


def test_an_overflow_is_refused_in_each_apis_words(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": LONG}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(HEAD)

    body = {"model": MODEL, "max_tokens": 32000, "messages": messages}
    anthropic = http.post("/v1/messages", json=body)
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert anthropic.json()["error"]["message"].startswith("prompt is too long: ")
    assert anthropic.json()["error"]["message"].endswith(" tokens > 8191 maximum")

    body = {"model": MODEL, "input": LONG, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as stream:
        assert stream.status_code == 200
        data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    failed = json.loads(data[-1])
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["code"] == "context_length_exceeded"


def test_a_reused_prefix_is_reported_as_cached(http: httpx.Client) -> None:
    # A prompt no other test sends: its first request computes it, the second reuses it.
    text = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 20
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
    }
    first, second = (http.post("/v1/chat/completions", json=body).json() for _ in range(2))
    prompt = second["usage"]["prompt_tokens"]
    cached_first = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached_second = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The second finds every full block of the first's prompt (the last token is always
    # computed): all but less than one block (16 tokens).
    assert prompt - 16 <= cached_second < prompt
    assert cached_first < prompt - 100  # the new text was computed the first time
    message = {"model": MODEL, "max_tokens": 1, "messages": body["messages"]}
    usage = http.post("/v1/messages", json=message).json()["usage"]
    assert usage["cache_read_input_tokens"] >= cached_second
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
