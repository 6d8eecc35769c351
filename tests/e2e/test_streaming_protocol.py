"""The server-sent-event protocol of streamed responses, read raw (no client library)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.conftest import MODEL
from tests.support.sse import DONE, open_events

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
PROMPT = "The capital of France is"


@pytest.fixture
async def http(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        yield client


async def read_all(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list:
    """Every event of a stream, ``[DONE]`` included."""
    async with open_events(client, path, body) as events:
        return [event async for event in events]


async def read_many(client: httpx.AsyncClient, requests: list[tuple[str, dict[str, Any]]]) -> list:
    """Several requests at once (batched by the server), in request order: a stream's
    events, or a non-streamed response's JSON body."""
    results: list = [None] * len(requests)

    async def one(i: int, path: str, body: dict[str, Any]) -> None:
        if body.get("stream"):
            results[i] = await read_all(client, path, body)
        else:
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            results[i] = response.json()

    async with trio.open_nursery() as nursery:
        for i, (path, body) in enumerate(requests):
            nursery.start_soon(one, i, path, body)
    return results


def check_envelope(events: list, obj: str) -> list[dict[str, Any]]:
    """``[DONE]`` comes last and only there; every chunk shares id, created and model, and
    every choice chunk has a ``finish_reason`` that is null except on the choice's last
    chunk. Returns the chunks."""
    assert events[-1] == DONE
    chunks = events[:-1]
    assert chunks and DONE not in chunks
    assert all("error" not in chunk for chunk in chunks)
    first = chunks[0]
    assert first["id"]
    for chunk in chunks:
        assert chunk["object"] == obj
        assert (chunk["id"], chunk["created"], chunk["model"]) == (
            first["id"],
            first["created"],
            MODEL,
        )
    finishes: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert "finish_reason" in choice
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    for index, reasons in finishes.items():
        assert all(reason is None for reason in reasons[:-1]), (index, reasons)
        assert reasons[-1] in {"stop", "length"}, (index, reasons)
    return chunks


def check_usage_chunk(chunks: list[dict[str, Any]]) -> dict[str, int]:
    """Exactly one usage chunk, with no choices, right before ``[DONE]``."""
    *before, last = chunks
    assert last["choices"] == []
    assert all("usage" not in chunk for chunk in before)
    assert all(chunk["choices"] for chunk in before)
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


async def test_chat_stream_protocol(http: httpx.AsyncClient, smol_tokenizer) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "stream": True,
    }
    with_usage, without, usage_off = await read_many(
        http,
        [
            ("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}),
            ("/v1/chat/completions", body),
            ("/v1/chat/completions", {**body, "stream_options": {"include_usage": False}}),
        ],
    )
    chunks = check_envelope(with_usage, "chat.completion.chunk")
    usage = check_usage_chunk(chunks)
    assert usage["prompt_tokens"] == len(
        smol_tokenizer.encode(smol_tokenizer.render_chat(CHAT), add_special_tokens=False)
    )

    deltas: dict[int, list[dict[str, Any]]] = {}
    num_logprobs = 0
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        deltas.setdefault(choice["index"], []).append(choice["delta"])
        if choice.get("logprobs"):
            num_logprobs += len(choice["logprobs"]["content"])
    assert sorted(deltas) == [0, 1]
    for index, choice_deltas in deltas.items():
        assert choice_deltas[0].get("role") == "assistant", index
        assert all("role" not in delta for delta in choice_deltas[1:]), index
        assert "".join(delta.get("content") or "" for delta in choice_deltas), index
    # Every output token is in exactly one chunk's logprobs.
    assert usage["completion_tokens"] == num_logprobs

    for events in (without, usage_off):
        plain = check_envelope(events, "chat.completion.chunk")
        assert all("usage" not in chunk and chunk["choices"] for chunk in plain)


async def test_completion_stream_protocol(http: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": 2,
        "ignore_eos": True,
    }
    streamed, whole, plain = await read_many(
        http,
        [
            (
                "/v1/completions",
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            ),
            ("/v1/completions", {**body, "stream": False}),
            ("/v1/completions", {**body, "stream": True, "echo": True}),
        ],
    )
    chunks = check_envelope(streamed, "text_completion")
    usage = check_usage_chunk(chunks)
    # Equal but for the prefix-cache hits (which of the two computed the prompt first).
    details = "prompt_tokens_details"
    assert {k: v for k, v in usage.items() if k != details} == {
        k: v for k, v in whole["usage"].items() if k != details
    }

    # Per choice, the chunks add up to the non-streamed choice, logprobs included.
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            assert "delta" not in choice and "role" not in choice
            i = choice["index"]
            texts[i] = texts.get(i, "") + choice["text"]
            tokens.setdefault(i, []).extend(choice["logprobs"]["tokens"])
            offsets.setdefault(i, []).extend(choice["logprobs"]["text_offset"])
    for choice in whole["choices"]:
        i = choice["index"]
        assert texts[i] == choice["text"] == "".join(tokens[i])
        assert tokens[i] == choice["logprobs"]["tokens"]
        assert offsets[i] == choice["logprobs"]["text_offset"]
        assert offsets[i] == [len("".join(tokens[i][:j])) for j in range(len(tokens[i]))]

    # With echo, each choice's first chunk starts with the prompt; no usage without asking.
    echoed = check_envelope(plain, "text_completion")
    assert all("usage" not in chunk and chunk["choices"] for chunk in echoed)
    echo_texts: dict[int, str] = {}
    echo_tokens: dict[int, list[str]] = {}
    echo_offsets: dict[int, list[int]] = {}
    for chunk in echoed:
        choice = chunk["choices"][0]
        i = choice["index"]
        if i not in echo_texts:
            assert choice["text"].startswith(PROMPT)
            assert choice["logprobs"]["token_logprobs"][0] is None
        echo_texts[i] = echo_texts.get(i, "") + choice["text"]
        echo_tokens.setdefault(i, []).extend(choice["logprobs"]["tokens"])
        echo_offsets.setdefault(i, []).extend(choice["logprobs"]["text_offset"])
    assert sorted(echo_texts) == [0, 1]
    for i, text in echo_texts.items():
        # The same samples as without echo (same seed), after the prompt; offsets run on.
        assert text == PROMPT + texts[i] == "".join(echo_tokens[i])
        assert echo_offsets[i] == [
            len("".join(echo_tokens[i][:j])) for j in range(len(echo_tokens[i]))
        ]


async def test_single_token_streams_are_complete(http: httpx.AsyncClient) -> None:
    # The first chunk of each choice is also its last.
    common = {"model": MODEL, "max_tokens": 1, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    completion, chat = await read_many(
        http,
        [
            ("/v1/completions", {**common, **usage, "prompt": PROMPT}),
            ("/v1/chat/completions", {**common, **usage, "messages": CHAT}),
        ],
    )
    chunks = check_envelope(completion, "text_completion")
    assert check_usage_chunk(chunks)["completion_tokens"] == 1
    assert len(chunks) == 2
    assert chunks[0]["choices"][0]["finish_reason"] == "length"

    chunks = check_envelope(chat, "chat.completion.chunk")
    assert check_usage_chunk(chunks)["completion_tokens"] == 1
    # The role rides on the one token's chunk, which also ends the choice.
    assert len(chunks) == 2
    token = chunks[0]["choices"][0]
    assert token["delta"]["role"] == "assistant"
    assert token["delta"]["content"]
    assert token["finish_reason"] == "length"


async def test_first_chat_chunk_carries_the_first_token(http: httpx.AsyncClient) -> None:
    # vLLM's benchmark_serving.py (--backend openai-chat) takes the arrival of the first
    # chunk with `choices` as the first token: that chunk must carry generated output,
    # or the benchmark reports the time to an empty role chunk as the TTFT.
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 5,
        "stream": True,
        "logprobs": True,
        "ignore_eos": True,
    }
    async with open_events(http, "/v1/chat/completions", body) as events:
        first = None
        async for event in events:
            if event != DONE and event.get("choices"):
                first = event["choices"][0]
                break
    assert first is not None
    assert first["delta"]["role"] == "assistant"
    assert first["delta"]["content"]
    # The content is that of generated tokens: their logprobs come with it.
    tokens = first["logprobs"]["content"]
    assert tokens and "".join(t["token"] for t in tokens) == first["delta"]["content"]
