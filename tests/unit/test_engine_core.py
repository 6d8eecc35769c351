"""EngineCore on a tiny random Llama: token-identical to transformers' generate()."""

from __future__ import annotations

import re

import pytest
import torch

from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.core import EngineConfigError, EngineCore
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.testing.tiny_model import build_tiny_model

PROMPTS = [
    [5, 6, 7, 8],
    [100, 200, 300],
    list(range(20, 57)),  # longer than the step budget: chunked prefill
    [11],
    list(range(300, 322)),
    [42, 42, 42, 42, 42, 42],
]


def _core(
    *,
    num_kv_blocks: int = 256,
    block_size: int = 4,
    budget: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
) -> EngineCore:
    model = build_tiny_model(seed=0)
    model.set_attn_implementation(ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
    )
    return EngineCore(model, config, "tiny")


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """Greedy continuations from transformers' generate(), one prompt at a time."""
    model = build_tiny_model(seed=0)
    model.set_attn_implementation("sdpa")
    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
        out[i] = ids[0, len(prompt) :].tolist()
    return out


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(core: EngineCore, *, late: dict[int, list[int]] | None = None) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests() or late:
        if late and steps in late:
            for i in late.pop(steps):
                assert core.add_request(AddRequest(f"r{i}", PROMPTS[i], _greedy())) is None
        result = core.step()
        steps += 1
        for output in result.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return outputs


def test_concurrent_greedy_outputs_match_generate(reference: dict[int, list[int]]) -> None:
    core = _core()
    for i, prompt in enumerate(PROMPTS):
        assert core.add_request(AddRequest(f"r{i}", prompt, _greedy())) is None
    outputs = _run(core)
    assert outputs == {f"r{i}": reference[i] for i in range(len(PROMPTS))}
    assert core.block_manager.num_free_blocks == 256


def test_requests_joining_mid_decode_match_generate(reference: dict[int, list[int]]) -> None:
    core = _core()
    outputs = _run(core, late={0: [0, 2], 5: [1, 3], 9: [4, 5]})
    assert outputs == {f"r{i}": reference[i] for i in range(len(PROMPTS))}


def test_preemption_and_recompute_keep_outputs_identical(reference: dict[int, list[int]]) -> None:
    # 24 blocks of 4 tokens cannot hold all six sequences at full length (57 blocks).
    core = _core(num_kv_blocks=24, max_model_len=64)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(AddRequest(f"r{i}", prompt, _greedy()))
    outputs: dict[str, list[int]] = {}
    preemptions = 0
    while core.has_unfinished_requests():
        result = core.step()
        preemptions += result.stats.num_preemptions
        for output in result.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert preemptions > 0
    assert outputs == {f"r{i}": reference[i] for i in range(len(PROMPTS))}


def test_abort_frees_blocks_and_drops_the_request() -> None:
    core = _core()
    core.add_request(AddRequest("a", PROMPTS[2], _greedy()))
    core.add_request(AddRequest("b", PROMPTS[0], _greedy()))
    for _ in range(5):
        core.step()
    core.abort(["a"])
    outputs = _run(core)
    assert set(outputs) == {"b"}
    assert core.block_manager.num_free_blocks == 256


@pytest.mark.parametrize(
    ("prompt", "params", "error"),
    [
        ([], _greedy(), "empty"),
        (list(range(128)), _greedy(), "max_model_len"),
        ([1, 512], _greedy(), r"\[0, 512\)"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
    ],
)
def test_invalid_requests_are_rejected_without_disturbing_others(
    prompt: list[int], params: SamplingParams, error: str
) -> None:
    core = _core()
    core.add_request(AddRequest("good", PROMPTS[0], _greedy(3)))
    rejected = core.add_request(AddRequest("bad", prompt, params))
    assert rejected is not None and rejected.finish_reason == "abort"
    assert rejected.error is not None
    assert re.search(error, rejected.error)
    assert len(_run(core)["good"]) == 3


def test_duplicate_request_ids_are_rejected() -> None:
    core = _core()
    assert core.add_request(AddRequest("x", [1, 2], _greedy())) is None
    rejected = core.add_request(AddRequest("x", [1, 2], _greedy()))
    assert rejected is not None and "duplicate" in (rejected.error or "")


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _core()
    alone.add_request(AddRequest("s", PROMPTS[0], params))
    crowded = _core()
    crowded.add_request(AddRequest("noise1", PROMPTS[1], SamplingParams(max_tokens=12)))
    crowded.add_request(AddRequest("s", PROMPTS[0], params))
    crowded.add_request(AddRequest("noise2", PROMPTS[4], SamplingParams(max_tokens=12, seed=5)))
    assert _run(alone)["s"] == _run(crowded)["s"]


def test_a_cache_smaller_than_the_context_is_a_config_error() -> None:
    model = build_tiny_model(seed=0)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=8),
    )
    with pytest.raises(EngineConfigError, match="max_model_len"):
        EngineCore(model, config, "tiny")
