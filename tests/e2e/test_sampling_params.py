"""Sampling parameters on the real model, each compared with a greedy baseline or a repeat."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import trio
from openai import OpenAI

from tests.e2e.conftest import MODEL, parallel, token_id

PROMPT = "Once upon a time"
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
#: A chat question the model answers in a few tokens, ending with EOS.
SHORT = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]
REPETITIVE = "the the the the"


# ------------------------------------------------------------------ n and batches

#: Three sampled choices of 6 tokens each (none ends early).
THREE: dict[str, Any] = {
    "n": 3,
    "max_tokens": 6,
    "temperature": 1.0,
    "extra_body": {"ignore_eos": True},
}


def test_n_samples_differ_and_a_seeded_response_is_reproducible(
    client: OpenAI, smol_tokenizer
) -> None:
    def sample(**kwargs: Any) -> Any:
        return client.completions.create(model=MODEL, prompt=PROMPT, seed=1234, **THREE, **kwargs)

    first, again, streamed = parallel(sample, sample, lambda: list(sample(stream=True)))
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3, texts
    assert [c.text for c in again.choices] == texts
    assert all(c.finish_reason == "length" for c in first.choices)
    # The prompt is counted once, the output of every choice.
    assert first.usage.prompt_tokens == len(smol_tokenizer.encode(PROMPT))
    assert first.usage.completion_tokens == 3 * 6
    assert first.usage.total_tokens == first.usage.prompt_tokens + 3 * 6

    by_index: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert by_index == dict(enumerate(texts))


def test_chat_n_three_streamed_and_not(client: OpenAI, smol_tokenizer) -> None:
    def chat(**kwargs: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=SHORT, seed=99, **THREE, **kwargs
        )

    whole, chunks = parallel(chat, lambda: list(chat(stream=True)))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in whole.choices)
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert whole.usage.prompt_tokens == len(
        smol_tokenizer.encode(smol_tokenizer.render_chat(SHORT), add_special_tokens=False)
    )
    assert whole.usage.completion_tokens == 3 * 6


def test_batch_prompts_times_n_are_numbered_prompt_major(client: OpenAI, smol_tokenizer) -> None:
    def complete(prompt: Any, **kwargs: Any) -> Any:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, **kwargs
        )

    ids = [smol_tokenizer.encode(p) for p in PROMPTS]
    batch, by_ids, alone_a, alone_b = parallel(
        lambda: complete(PROMPTS, n=2),
        lambda: complete(ids),
        lambda: complete(PROMPTS[0]),
        lambda: complete(PROMPTS[1]),
    )
    alone = [alone_a.choices[0].text, alone_b.choices[0].text]
    assert alone[0] != alone[1]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # index = prompt_index * n + sample; greedy samples of one prompt are its text alone.
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert batch.usage.completion_tokens == 4 * 6

    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == alone
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


async def test_a_seeded_request_is_reproducible_in_a_busy_batch(base_url: str) -> None:
    seeded = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 4242,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:

        async def complete(body: dict[str, Any]) -> str:
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        alone = await complete(seeded)
        results: dict[int, str] = {}

        async def run(i: int, body: dict[str, Any]) -> None:
            results[i] = await complete(body)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                busy = {**seeded, "max_tokens": 10}
                del busy["seed"]  # these draw from the engine's shared generator
                nursery.start_soon(run, i, busy)
            nursery.start_soon(run, -1, seeded)
    assert results[-1] == alone
    # The unseeded neighbours (same prompt) really sampled: not all the same continuation.
    assert len({results[i] for i in range(8)}) > 1


# ------------------------------------------------------------------ logits processing


def _tokens(reply: Any) -> list[str]:
    return reply.choices[0].logprobs.tokens


def test_logit_bias_forces_or_forbids_a_token(client: OpenAI, smol_tokenizer) -> None:
    def complete(**kwargs: Any) -> Any:
        return client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0, **kwargs
        )

    baseline = complete()
    first = token_id(smol_tokenizer, _tokens(baseline)[0])
    forced_text = " banana"
    forced = token_id(smol_tokenizer, forced_text)
    assert forced_text not in baseline.choices[0].text
    pushed, banned = parallel(
        lambda: complete(logit_bias={str(forced): 100}),
        lambda: complete(logit_bias={str(first): -100}),
    )
    assert _tokens(pushed) == [forced_text] * 4
    # Greedy logprobs come after logit_bias: the forced token is (almost) certain.
    assert all(lp > -1e-3 for lp in pushed.choices[0].logprobs.token_logprobs)
    assert pushed.choices[0].text == forced_text * 4
    assert _tokens(banned)[0] != _tokens(baseline)[0]


def test_min_tokens_generates_past_the_eos(client: OpenAI) -> None:
    def chat(**kwargs: Any) -> Any:
        return client.chat.completions.create(model=MODEL, messages=SHORT, temperature=0, **kwargs)

    # No max_tokens: the rest of the context, but a short reply ends on EOS long before.
    baseline, longer, capped = parallel(
        chat,
        lambda: chat(max_tokens=16, extra_body={"min_tokens": 10}),
        lambda: chat(max_completion_tokens=2),
    )
    reply = baseline.choices[0].message.content
    assert baseline.choices[0].finish_reason == "stop"
    assert baseline.usage.completion_tokens < 10

    assert longer.usage.completion_tokens >= 10
    assert longer.choices[0].message.content.startswith(reply)
    assert len(longer.choices[0].message.content) > len(reply)

    assert capped.usage.completion_tokens == 2
    assert capped.choices[0].finish_reason == "length"
    assert reply.startswith(capped.choices[0].message.content)


def test_penalties_break_a_repetitive_greedy_output(client: OpenAI) -> None:
    def complete(**kwargs: Any) -> Any:
        return client.completions.create(
            model=MODEL, prompt=REPETITIVE, max_tokens=12, temperature=0, logprobs=0, **kwargs
        )

    baseline, frequency, presence, repetition = parallel(
        complete,
        lambda: complete(frequency_penalty=2.0),
        lambda: complete(presence_penalty=2.0),
        lambda: complete(extra_body={"repetition_penalty": 1.5}),
    )
    most_repeated = Counter(_tokens(baseline)).most_common(1)[0][1]
    assert most_repeated >= 4, _tokens(baseline)
    for penalized in (frequency, presence, repetition):
        assert penalized.choices[0].text != baseline.choices[0].text
        assert Counter(_tokens(penalized)).most_common(1)[0][1] < most_repeated


def test_skip_special_tokens_false_keeps_special_token_text(client: OpenAI) -> None:
    # <|im_start|>, three ordinary tokens, <|im_end|>: echoed back without generating.
    prompt = [1, 504, 3458, 282, 2]

    def echo(**kwargs: Any) -> str:
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, **kwargs
        )
        return reply.choices[0].text

    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=SHORT,
            temperature=0,
            max_tokens=16,
            extra_body={"include_stop_str_in_output": True, **extra},
        )

    skipped, kept, chat_skipped, chat_kept = parallel(
        echo,
        lambda: echo(extra_body={"skip_special_tokens": False}),
        chat,
        lambda: chat(skip_special_tokens=False),
    )
    assert "<|im_start|>" not in skipped
    assert "<|im_end|>" not in skipped
    assert kept == f"<|im_start|>{skipped}<|im_end|>"

    # The EOS that ends the reply is included, and spelled out only when not skipped.
    assert chat_skipped.choices[0].finish_reason == "stop"
    assert chat_kept.choices[0].message.content == (
        chat_skipped.choices[0].message.content + "<|im_end|>"
    )
