"""Logprobs in both OpenAI formats, checked against a transformers reference (fp32).

The sampler's logprobs are the log-softmax of the processed logits a token was drawn from;
for greedy requests (temperature 0) nothing is processed, so they are the model's own
log-softmax, which transformers computes from the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from openai import OpenAI

from tests.e2e.conftest import MODEL, token_id

TOLERANCE = 1e-3
#: A prompt whose greedy continuation runs well past 8 tokens without an EOS.
PROMPT = "The capital of France is"
#: A chat reply made of multi-byte characters (split across tokens) that runs to the limit.
EMOJI = [{"role": "user", "content": "Repeat this emoji: 🌞"}]
#: A chat reply that ends with EOS after a few tokens.
SHORT = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]


@pytest.fixture(scope="module")
def hf_model(real_model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


def reference(model, token_ids: list[int]) -> torch.Tensor:
    """Row ``i``: log-softmax of the next-token distribution after ``token_ids[: i + 1]``."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def assert_text_offsets(logprobs, start: int = 0) -> None:
    offsets = logprobs.text_offset
    assert offsets[0] == start
    for i in range(1, len(offsets)):
        assert offsets[i] == offsets[i - 1] + len(logprobs.tokens[i - 1])


def assert_position_matches(ref_row: torch.Tensor, chosen: int, logprob, top, k: int, tokenizer):
    """One completions position against the reference: the chosen token and the top ``k``."""
    assert logprob == pytest.approx(ref_row[chosen].item(), abs=TOLERANCE)
    values, ids = ref_row.topk(k)
    expected = {tokenizer.token_text(int(t)): v.item() for t, v in zip(ids, values, strict=True)}
    expected.setdefault(tokenizer.token_text(chosen), ref_row[chosen].item())
    assert top.keys() == expected.keys()
    for text, value in expected.items():
        assert top[text] == pytest.approx(value, abs=TOLERANCE), text


def test_completion_logprobs_match_the_reference(client: OpenAI, hf_model, smol_tokenizer) -> None:
    k = 5
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=k
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert_text_offsets(logprobs)
    assert all(isinstance(top, dict) and len(top) == k for top in logprobs.top_logprobs)

    prompt_ids = smol_tokenizer.encode(PROMPT)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    output_ids = [token_id(smol_tokenizer, token) for token in logprobs.tokens]
    ref = reference(hf_model, prompt_ids + output_ids)[len(prompt_ids) - 1 :]
    for i, chosen in enumerate(output_ids):
        assert chosen == ref[i].argmax().item(), f"token {i} is not the greedy choice"
        assert_position_matches(
            ref[i], chosen, logprobs.token_logprobs[i], logprobs.top_logprobs[i], k, smol_tokenizer
        )


def test_sampled_logprobs_are_those_of_the_processed_distribution(
    client: OpenAI, hf_model, smol_tokenizer
) -> None:
    # Temperature, then top_k: the logprobs are the log-softmax of logits / T with every
    # token outside the top k at -inf (sent as -9999.0).
    temperature, top_k, k = 0.7, 3, 4
    reply = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=temperature,
        seed=5,
        logprobs=k,
        extra_body={"top_k": top_k, "ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    prompt_ids = smol_tokenizer.encode(PROMPT)
    output_ids = [token_id(smol_tokenizer, token) for token in logprobs.tokens]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    for i, chosen in enumerate(output_ids):
        row = logits[len(prompt_ids) - 1 + i] / temperature
        kept = row.topk(top_k).indices
        masked = torch.full_like(row, -torch.inf)
        masked[kept] = row[kept]
        expected = masked.log_softmax(dim=-1)
        assert chosen in kept.tolist(), f"token {i} was drawn from outside the top {top_k}"
        assert logprobs.token_logprobs[i] == pytest.approx(expected[chosen].item(), abs=TOLERANCE)
        top = logprobs.top_logprobs[i]
        assert len(top) == k
        values = sorted(top.values(), reverse=True)
        assert values[:top_k] == pytest.approx(expected[kept].tolist(), abs=TOLERANCE)
        assert values[top_k:] == [-9999.0] * (k - top_k)


def test_echo_returns_prompt_logprobs_matching_the_reference(
    client: OpenAI, hf_model, smol_tokenizer
) -> None:
    k = 3
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=k, echo=True
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    prompt_ids = smol_tokenizer.encode(PROMPT)
    n = len(prompt_ids)
    assert choice.text.startswith(PROMPT)
    assert len(logprobs.tokens) == n + 4 == reply.usage.prompt_tokens + 4
    assert logprobs.tokens[:n] == [smol_tokenizer.token_text(t) for t in prompt_ids]
    assert "".join(logprobs.tokens) == choice.text
    assert_text_offsets(logprobs)
    # The first prompt token has nothing before it, hence no logprob.
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None

    output_ids = [token_id(smol_tokenizer, token) for token in logprobs.tokens[n:]]
    all_ids = prompt_ids + output_ids
    ref = reference(hf_model, all_ids)
    for i in range(1, len(all_ids)):
        top = logprobs.top_logprobs[i]
        # Prompt tokens need not be among the top k: then they are listed besides.
        assert len(top) == (k if all_ids[i] in ref[i - 1].topk(k).indices else k + 1)
        assert_position_matches(
            ref[i - 1], all_ids[i], logprobs.token_logprobs[i], top, k, smol_tokenizer
        )


def test_vllm_prompt_logprobs_match_the_reference(client: OpenAI, hf_model, smol_tokenizer) -> None:
    k = 2
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": k}
    )
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = smol_tokenizer.encode(PROMPT)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    ref = reference(hf_model, prompt_ids)
    for i in range(1, len(prompt_ids)):
        position = {int(token): value for token, value in entries[i].items()}
        expected_top = ref[i - 1].topk(k)
        actual = prompt_ids[i]
        assert set(position) == {*expected_top.indices.tolist(), actual}
        for rank, (token, logprob) in enumerate(
            zip(expected_top.indices.tolist(), expected_top.values.tolist(), strict=True), 1
        ):
            assert position[token]["rank"] == rank
            assert position[token]["logprob"] == pytest.approx(logprob, abs=TOLERANCE)
            assert position[token]["decoded_token"] == smol_tokenizer.token_text(token)
        expected_rank = 1 + int((ref[i - 1] > ref[i - 1][actual]).sum())
        assert position[actual]["rank"] == expected_rank
        assert position[actual]["logprob"] == pytest.approx(
            float(ref[i - 1][actual]), abs=TOLERANCE
        )


def test_echo_with_max_tokens_zero_returns_exactly_the_prompt(
    client: OpenAI, smol_tokenizer
) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    num_prompt = len(smol_tokenizer.encode(PROMPT))
    for reply in (plain, scored):
        assert len(reply.choices) == 1
        assert reply.choices[0].text == PROMPT
        assert reply.usage.completion_tokens == 0
        assert reply.usage.prompt_tokens == num_prompt == reply.usage.total_tokens
    assert plain.choices[0].logprobs is None
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == num_prompt
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None
    assert all(isinstance(value, float) and value <= 0 for value in logprobs.token_logprobs[1:])


def test_chat_logprobs_match_the_reference(client: OpenAI, hf_model, smol_tokenizer) -> None:
    k = 4
    reply = client.chat.completions.create(
        model=MODEL, messages=EMOJI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=k
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == 8 == reply.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str)
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == k
        assert all(alt.bytes for alt in entry.top_logprobs)
    # A character split over tokens is whole again once the tokens' bytes are joined; a
    # character cut off by max_tokens shows as U+FFFD, both in the text and when decoding.
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert any(ord(c) > 0xFFFF for c in joined.decode("utf-8", "replace"))
    assert joined.decode("utf-8", "replace") == choice.message.content

    prompt_ids = smol_tokenizer.encode(smol_tokenizer.render_chat(EMOJI), add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    output_ids = [token_id(smol_tokenizer, entry.bytes) for entry in content]
    ref = reference(hf_model, prompt_ids + output_ids)[len(prompt_ids) - 1 :]
    for i, entry in enumerate(content):
        chosen = output_ids[i]
        assert chosen == ref[i].argmax().item()
        assert entry.logprob == pytest.approx(ref[i][chosen].item(), abs=TOLERANCE)
        values, ids = ref[i].topk(k)
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(
            values.tolist(), abs=TOLERANCE
        )
        assert [token_id(smol_tokenizer, alt.bytes) for alt in entry.top_logprobs] == ids.tolist()


def test_chat_logprob_bytes_spell_a_reply_that_ends_on_eos(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=16, temperature=0, logprobs=True
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    joined = b"".join(bytes(entry.bytes) for entry in choice.logprobs.content)
    assert joined == choice.message.content.encode()
