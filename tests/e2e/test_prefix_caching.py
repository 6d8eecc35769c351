"""Prefix caching on the real server: a long shared prefix is computed once, outputs unchanged."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx

from tests.e2e.conftest import MODEL, parallel
from tests.e2e.test_metrics import _delta, _scrape

SONNETS = Path(__file__).resolve().parents[2] / "bench" / "data" / "sonnet.txt"
QUESTIONS = ["Summarise the poem.", "Who is speaking?", "Name one image.", "Is it sad?"]
HITS = "trio_llm:prefix_cache_hits_total"
QUERIES = "trio_llm:prefix_cache_queries_total"


def _complete(base_url: str, prompt: str, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_shared_system_prompt_is_reused_and_outputs_do_not_change(base_url: str) -> None:
    # A fresh nonce first, so no block of this prefix can be in the cache already.
    lines = SONNETS.read_text().splitlines()[:18]
    system = f"[{uuid.uuid4().hex}] Read the poem, then answer.\n" + "\n".join(lines) + "\n"
    prompts = [f"{system}Question: {q}\nAnswer:" for q in QUESTIONS]

    # References: echo + logprobs asks for prompt logprobs, which never use cached blocks.
    before = _scrape(base_url)
    references = []
    for prompt in prompts:
        reply = _complete(base_url, prompt, echo=True, logprobs=0)
        text = reply["choices"][0]["text"]
        assert text.startswith(prompt)
        references.append(text[len(prompt) :])
    middle = _scrape(base_url)
    assert _delta(before, middle, HITS) == 0

    # Eight requests at once, two per question: each finds the shared prefix cached.
    replies = parallel(*(lambda p=p: _complete(base_url, p) for p in prompts * 2))
    after = _scrape(base_url)
    assert [r["choices"][0]["text"] for r in replies] == references * 2
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in replies]
    assert _delta(middle, after, QUERIES) == sum(prompt_tokens)
    # Every request finds at least the full 16-token blocks of the tokens all prompts share.
    tokens = [_tokenize(base_url, prompt) for prompt in prompts]
    shared = 0
    while all(len(t) > shared and t[shared] == tokens[0][shared] for t in tokens):
        shared += 1
    assert shared >= 160
    assert _delta(middle, after, HITS) >= 8 * (shared // 16) * 16


def _tokenize(base_url: str, prompt: str) -> list[int]:
    reply = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]
