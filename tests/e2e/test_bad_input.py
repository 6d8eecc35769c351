"""Bad requests get OpenAI-style 4xx errors and disturb nothing else."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.conftest import MODEL, completion_body

CHAT = [{"role": "user", "content": "hi"}]


def _json(body: dict) -> dict:
    """Request arguments for ``body`` as Python's json writes it: escaped lone surrogates
    and ``Infinity`` included (httpx's own encoder refuses both)."""
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


LONG_PROMPT = "word " * 9000  # about 9,000 tokens, past the 8,192-token context

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"

CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("prompt too long", COMPLETIONS, {"prompt": LONG_PROMPT}, 400, "prompt"),
    (
        "chat prompt too long",
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 5},
        400,
        "messages",
    ),
    ("max_tokens 0", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    # A max_tokens past the context is clamped to the room left (a 400 only with
    # --max-tokens-policy strict): tests/unit/api/chat/test_context_errors.py.
    (
        "negative temperature",
        COMPLETIONS,
        {"prompt": "hi", "temperature": -0.5},
        400,
        "temperature",
    ),
    ("top_p zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", CHAT_COMPLETIONS, {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("prompt wrong type", COMPLETIONS, {"prompt": 12}, 400, "prompt"),
    (
        "max_tokens wrong type",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": "many"},
        400,
        "max_tokens",
    ),
    ("stream wrong type", COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("token id out of range", COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("no messages", CHAT_COMPLETIONS, {"messages": []}, 400, "messages"),
    ("bad role", CHAT_COMPLETIONS, {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("chat max_tokens 0", CHAT_COMPLETIONS, {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("n zero", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    ("n past the limit", COMPLETIONS, {"prompt": "hi", "n": 10_000}, 400, "n"),
    ("stop wrong type", COMPLETIONS, {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("logprobs past the limit", COMPLETIONS, {"prompt": "hi", "logprobs": 25}, 400, "logprobs"),
    (
        "top_logprobs without logprobs",
        CHAT_COMPLETIONS,
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs past the limit",
        CHAT_COMPLETIONS,
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "logit_bias key not a number",
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias key outside the vocabulary",
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"99999999": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias value not a number",
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"5": "x"}},
        400,
        "logit_bias",
    ),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (
        "user message without content",
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user"}]},
        400,
        "messages",
    ),
    ("best_of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("best_of true is not 1", COMPLETIONS, {"prompt": "hi", "best_of": True}, 400, "best_of"),
    (
        "use_beam_search 0 is not false",
        COMPLETIONS,
        {"prompt": "hi", "use_beam_search": 0},
        400,
        "use_beam_search",
    ),
    (
        "min_tokens above max_tokens",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    (
        "presence_penalty out of range",
        COMPLETIONS,
        {"prompt": "hi", "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        "stop_token_ids outside the vocabulary",
        COMPLETIONS,
        {"prompt": "hi", "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
    ),
    (
        "prompt too long, streamed",
        COMPLETIONS,
        {"prompt": LONG_PROMPT, "stream": True},
        400,
        "prompt",
    ),
    ("empty prompt in a batch", COMPLETIONS, {"prompt": ["hi", ""]}, 400, "prompt"),
    ("missing prompt", COMPLETIONS, {}, 400, "prompt"),
    ("seed past 64 bits", COMPLETIONS, {"prompt": "hi", "seed": 10**23}, 400, "seed"),
    ("top_k past 32 bits", COMPLETIONS, {"prompt": "hi", "top_k": 10**23}, 400, "top_k"),
    (
        "stream seed past 64 bits",
        COMPLETIONS,
        {"prompt": "hi", "seed": 10**23, "stream": True},
        400,
        "seed",
    ),
    (
        "infinite temperature",
        COMPLETIONS,
        {"prompt": "hi", "temperature": float("inf")},
        400,
        "temperature",
    ),
    ("lone surrogate", COMPLETIONS, {"prompt": "hi \ud800 there"}, 400, "prompt"),
    (
        "lone surrogate in chat",
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user", "content": "\ud800"}]},
        400,
        "messages",
    ),
    ("huge prompt", COMPLETIONS, {"prompt": "hello world " * 300_000}, 400, "prompt"),
    ("body too large", COMPLETIONS, {"prompt": "hello world " * 1_000_000}, 413, None),
    (
        "repetition_penalty zero",
        COMPLETIONS,
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "stream_options without stream",
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("unknown model", COMPLETIONS, {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("embeddings of a generator", EMBEDDINGS, {"input": "hi"}, 400, "model"),
    (
        "prompt_logprobs streamed",
        COMPLETIONS,
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs past the limit",
        COMPLETIONS,
        {"prompt": "hi", "prompt_logprobs": 21},
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs on chat",
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
        400,
        "prompt_logprobs",
    ),
]


def test_an_image_part_is_refused_as_text_only(base_url: str) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "'image_url'" in error["message"] and "text only" in error["message"]
    assert "Input should be" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_gets_an_openai_error(
    base_url: str, path: str, body: dict, status: int, param: str | None
) -> None:
    response = httpx.post(f"{base_url}{path}", **_json({"model": MODEL, **body}), timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param


def test_a_non_json_content_type_gets_400(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/completions",
        content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
        headers={"content-type": "text/plain"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [0], "max_tokens": 2},  # token id 0 is a valid token
        {"prompt": "hi", "max_tokens": 2, "some_future_field": {"x": 1}},  # unknown: ignored
        {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1000}},  # clamped to 100
        {"prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None},  # defaults
    ],
    ids=["token id 0", "unknown field", "logit_bias clamped", "null means default"],
)
def test_edge_inputs_that_are_valid_get_answers(base_url: str, body: dict) -> None:
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_bodies_get_400(base_url: str, payload: bytes) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        content=payload,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_is_an_openai_404(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/nothing-here", json={}, timeout=30)
    assert response.status_code == 404
    # The status line has its reason phrase (clients print it as the error).
    assert response.reason_phrase == "Not Found"
    error = response.json()["error"]
    assert error["type"] == "not_found_error"
    assert "POST /v1/nothing-here" in error["message"]
    assert "/v1/chat/completions" in error["message"]


def test_status_lines_carry_reason_phrases(base_url: str) -> None:
    bad = httpx.post(f"{base_url}/v1/completions", json={"prompt": 3}, timeout=30)
    assert (bad.status_code, bad.reason_phrase) == (400, "Bad Request")
    ok = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert (ok.status_code, ok.reason_phrase) == (200, "OK")
    wrong_method = httpx.get(f"{base_url}/v1/completions", timeout=30)
    assert (wrong_method.status_code, wrong_method.reason_phrase) == (405, "Method Not Allowed")
    assert "GET" in wrong_method.json()["error"]["message"]


async def test_bad_requests_do_not_disturb_a_request_in_flight(base_url: str) -> None:
    good = completion_body("Once upon a time", 24, temperature=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        alone = (await client.post("/v1/completions", json=good)).json()["choices"][0]["text"]
        results: dict[str, Any] = {}

        async def run_good() -> None:
            results["good"] = (await client.post("/v1/completions", json=good)).json()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_good)
            for _, path, body, status, _ in CASES:
                response = await client.post(path, **_json({"model": MODEL, **body}))
                assert response.status_code == status
        assert results["good"]["choices"][0]["text"] == alone
        assert (await client.get("/health")).status_code == 200
