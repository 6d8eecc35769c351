"""Real batching on the real model: identical outputs, interleaving, joining mid-decode."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
import trio

from tests.e2e.conftest import MODEL, completion_body
from tests.support.sse import DONE, delta_text, open_events

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain gravity to a child in two sentences.",
    "Say hello in Spanish, French and German.",
    "What is 12 times 12?",
    "Name a famous play by Shakespeare.",
    "Give me a tip for learning to cook.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(smol_tokenizer) -> list[list[int]]:
    return [
        smol_tokenizer.encode(
            smol_tokenizer.render_chat([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def reference(real_model_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers generate(), greedy, fp32, each prompt alone."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


async def test_concurrent_greedy_outputs_are_token_identical_to_generate(
    base_url: str, prompt_ids: list[list[int]], reference: list[list[int]], smol_tokenizer
) -> None:
    results: dict[int, dict] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(i: int) -> None:
            # Token-id prompts: the comparison does not depend on prompt tokenization.
            body = {
                "model": MODEL,
                "prompt": prompt_ids[i],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            results[i] = response.json()

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)

    for i, expected in enumerate(reference):
        eos_trimmed = expected[:-1] if expected and expected[-1] == 2 else expected
        choice = results[i]["choices"][0]
        assert results[i]["usage"]["completion_tokens"] == len(expected), PROMPTS[i]
        assert choice["text"] == smol_tokenizer.decode(eos_trimmed), PROMPTS[i]
        assert choice["finish_reason"] == ("stop" if len(expected) < MAX_TOKENS else "length")


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"trio_llm:{name}"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_sixteen_streams_are_batched_and_interleave(base_url: str) -> None:
    first_token_at: dict[int, int] = {}
    finished_at: dict[int, int] = {}
    order = iter(range(10**9))
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        multi_before = await _metric(client, "engine_steps_multi_request_total")

        async def stream(i: int) -> None:
            body = completion_body(f"Story number {i}: once upon a time", 48, stream=True)
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    if event == DONE:
                        finished_at[i] = next(order)
                    elif delta_text(event) and i not in first_token_at:
                        first_token_at[i] = next(order)

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(stream, i)
        multi_after = await _metric(client, "engine_steps_multi_request_total")

    assert len(finished_at) == 16
    # Every stream produced text before any stream finished: they ran together.
    assert max(first_token_at.values()) < min(finished_at.values())
    assert multi_after - multi_before >= 40


async def test_a_new_request_starts_while_others_are_mid_decode(base_url: str) -> None:
    timeline: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        long_started = trio.Semaphore(0)

        async def long_stream(i: int) -> None:
            body = completion_body(f"Count to {i}00:", 64, stream=True)
            seen = 0
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    if event == DONE:
                        timeline.append(f"long{i} done")
                    elif delta_text(event):
                        seen += 1
                        if seen == 4:
                            long_started.release()

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(long_stream, i)
            for _ in range(4):
                await long_started.acquire()
            timeline.append("late sent")
            body = completion_body("Hi", 2, stream=True)
            async with open_events(client, "/v1/completions", body) as events:
                async for event in events:
                    if event != DONE and delta_text(event) and "late first token" not in timeline:
                        timeline.append("late first token")

    late = timeline.index("late first token")
    assert all(timeline.index(f"long{i} done") > late for i in range(4)), timeline
