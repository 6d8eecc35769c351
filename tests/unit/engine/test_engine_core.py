"""EngineCore on a tiny random Llama: token-identical to transformers' generate()."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.tiny_model import build_tiny_model
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.core import EngineCore
from trio_llm.errors import EngineConfigError
from trio_llm.messages import AddRequest, SamplingParams, Scheduling

#: Runs an engine core (in this process, a real model forward pass per step): the slow tier.
pytestmark = pytest.mark.slow

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
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
) -> EngineCore:
    model = build_tiny_model(seed=0)
    model.set_attn_implementation(ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=max_model_len),
        cache=CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, scheduling_policy=policy
        ),
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


def test_priorities_and_the_batch_lane_keep_outputs_identical(
    reference: dict[int, list[int]],
) -> None:
    # Two batch slots: a batch-lane request and a low priority hold them when two better
    # requests arrive; the low one is preempted for the best and recomputed later.
    core = _core(max_num_seqs=2, policy="priority")
    assert core.ready_message(1).scheduling_policy == "priority"
    arrivals = {
        0: [(0, Scheduling(batch=True)), (1, Scheduling(priority=5))],
        3: [(2, Scheduling(priority=0)), (3, Scheduling(priority=1))],
    }
    outputs: dict[str, list[int]] = {}
    finished: list[str] = []
    preemptions = 0
    step = 0
    while core.has_unfinished_requests() or arrivals:
        for i, scheduling in arrivals.pop(step, []):
            message = AddRequest(f"r{i}", PROMPTS[i], _greedy(), None, scheduling)
            assert core.add_request(message) is None
        result = core.step()
        step += 1
        preemptions += result.stats.num_preemptions
        for output in result.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.append(output.request_id)
    assert preemptions > 0
    assert outputs == {f"r{i}": reference[i] for i in range(4)}
    # The best priority first, the batch lane (which kept its one slot) before r3 took it.
    assert finished.index("r2") < finished.index("r3") < finished.index("r1")


def test_a_priority_is_refused_under_fcfs() -> None:
    core = _core()
    assert core.ready_message(1).scheduling_policy == "fcfs"
    refused = core.add_request(AddRequest("p", [5, 6], _greedy(), None, Scheduling(priority=1)))
    assert refused is not None and refused.finish_reason == "abort"
    assert "priority scheduling is not enabled" in (refused.error or "")
    batch = AddRequest("b", [5, 6], _greedy(2), None, Scheduling(batch=True))
    assert core.add_request(batch) is None
    assert len(_run(core)["b"]) == 2  # the batch lane is served under fcfs too


def test_prefix_caching_keeps_outputs_identical_and_counts_hits() -> None:
    shared = list(range(100, 137))  # 37 tokens: 9 full blocks of 4 are shareable
    # Token 2 is the tiny model's pad token, which generate() would mask: suffixes avoid it.
    suffixes = ([11], [12, 13], [14, 15, 16, 17, 18], [], [19] * 11)
    prompts = [shared + suffix for suffix in suffixes]
    model = build_tiny_model(seed=0)
    model.set_attn_implementation("sdpa")
    reference = [
        model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        for prompt in prompts
    ]
    results = {}
    for enabled in (True, False):
        core = _core(enable_prefix_caching=enabled, budget=64)
        outputs: dict[str, list[int]] = {}
        # The first prompt alone, then the others together, then all again.
        waves = [[0], [1, 2, 3, 4], [0, 1, 2, 3, 4]]
        for wave_index, wave in enumerate(waves):
            for i in wave:
                message = AddRequest(f"w{wave_index}-{i}", prompts[i], _greedy(12))
                assert core.add_request(message) is None
            while core.has_unfinished_requests():
                for output in core.step().outputs:
                    outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        stats = core.stats()
        results[enabled] = outputs, stats.prefix_cache_queries, stats.prefix_cache_hits
    for enabled in (True, False):
        outputs = results[enabled][0]
        assert outputs == {f"w{w}-{i}": reference[i] for w, wave in enumerate(waves) for i in wave}
    _, queries, hits = results[True]
    assert queries == sum(len(prompts[i]) for wave in waves for i in wave)
    # Wave 1: four prompts share 9 blocks of the first (36 tokens); wave 2: five prompts
    # find at least those 9 blocks, most of them more (their own earlier blocks).
    assert hits >= 4 * 36 + 5 * 36
    assert results[False][1:] == (0, 0)


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
        ([1], SamplingParams(max_tokens=-1), "max_tokens"),
        ([1], SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(logit_bias=((512, 1.0),)), r"\[0, 512\)"),
        ([1], SamplingParams(stop_token_ids=(-1,)), r"\[0, 512\)"),
        ([1], SamplingParams(presence_penalty=3.0), "presence_penalty"),
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


def _collect(core: EngineCore) -> dict[str, list]:
    """Every output of every step, per request id, until the core is idle."""
    outputs: dict[str, list] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_logprobs_match_a_full_forward_pass() -> None:
    """Prompt logprobs (across chunked prefill) and output logprobs, against plain torch."""
    prompt = PROMPTS[2]  # 37 tokens: three chunks at a 16-token budget
    core = _core()
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=3
    )
    core.add_request(AddRequest("r", prompt, params))
    outputs = _collect(core)["r"]
    tokens = [t for o in outputs for t in o.new_token_ids]
    prompt_entries = [e for o in outputs for e in o.prompt_logprobs or []]
    output_entries = [e for o in outputs for e in o.logprobs or []]

    model = build_tiny_model(seed=0)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    reference = logits.log_softmax(-1)
    sequence = prompt + tokens
    # Position 0 has no logprob; every later prompt position exactly once, in order.
    assert [e.token_id for e in prompt_entries] == prompt[1:]
    assert [e.token_id for e in output_entries] == tokens
    for position, entry in enumerate(prompt_entries + output_entries, start=1):
        row = reference[position - 1]
        assert entry.token_id == sequence[position]
        assert abs(entry.logprob - float(row[entry.token_id])) < 1e-3
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top = row.topk(len(entry.top_token_ids))
        assert entry.top_token_ids == top.indices.tolist()
    assert all(len(e.top_token_ids) == 3 for e in prompt_entries)
    assert all(len(e.top_token_ids) == 2 for e in output_entries)


def test_max_tokens_zero_returns_only_prompt_logprobs() -> None:
    core = _core()
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    core.add_request(AddRequest("r", PROMPTS[0], params))
    outputs = _collect(core)["r"]
    assert [t for o in outputs for t in o.new_token_ids] == []
    assert outputs[-1].finish_reason == "length"
    entries = [e for o in outputs for e in o.prompt_logprobs or []]
    assert [e.token_id for e in entries] == PROMPTS[0][1:]
    assert core.block_manager.num_free_blocks == 256


def test_prompt_logprobs_survive_preemption_without_repeats() -> None:
    core = _core(num_kv_blocks=32, block_size=4, budget=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(AddRequest(f"r{i}", prompt, params))
    outputs = _collect(core)
    for i, prompt in enumerate(PROMPTS):
        entries = [e for o in outputs[f"r{i}"] for e in o.prompt_logprobs or []]
        assert [e.token_id for e in entries] == prompt[1:]


def test_queue_time_is_reported_once_per_request() -> None:
    core = _core(max_num_seqs=1)
    core.add_request(AddRequest("a", PROMPTS[0], _greedy(3)))
    core.add_request(AddRequest("b", PROMPTS[1], _greedy(3)))
    outputs = _collect(core)
    for request_id in ("a", "b"):
        reported = [o.queue_seconds for o in outputs[request_id] if o.queue_seconds is not None]
        assert len(reported) == 1
        assert reported[0] >= 0
    # b waited for the whole of a (max_num_seqs=1).
    assert outputs["b"][0].queue_seconds > outputs["a"][0].queue_seconds


def test_sampling_params_reach_the_sampler(reference: dict[int, list[int]]) -> None:
    """logit_bias, min_tokens and a penalty change the tiny model's greedy output."""
    greedy_first = reference[0][0]
    cases = {
        "bias": SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((7, 100.0),)),
        "min": SamplingParams(
            max_tokens=4, temperature=0.0, min_tokens=2, stop_token_ids=(greedy_first,)
        ),
        "stop": SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(greedy_first,)),
        "penalty": SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1000.0
        ),
    }
    core = _core()
    for name, params in cases.items():
        prompt = PROMPTS[2] if name == "penalty" else PROMPTS[0]
        core.add_request(AddRequest(name, prompt, params))
    outputs = _run(core)
    assert outputs["bias"] == [7, 7, 7, 7]
    assert outputs["stop"] == [greedy_first]  # the stop token ends it at once
    assert outputs["min"][0] != greedy_first  # ... but not before min_tokens
    assert len(outputs["min"]) >= 2
    # A huge repetition penalty: no token of the prompt or of earlier output comes again.
    penalized = outputs["penalty"]
    assert len(set(penalized)) == len(penalized) == 24
    assert not set(penalized) & set(PROMPTS[2])
    plain = reference[2]  # repeats tokens and reuses prompt tokens: the penalty must act
    assert len(set(plain)) < len(plain) and set(plain) & set(PROMPTS[2])


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_pausing_and_resuming_does_not_change_the_output(
    reference: dict[int, list[int]], enable_prefix_caching: bool
) -> None:
    """A request paused mid-generation (its consumer stopped reading) and resumed later
    is recomputed and continues exactly: greedy as generate(), seeded as when never paused."""
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    plain = _core(enable_prefix_caching=enable_prefix_caching)
    plain.add_request(AddRequest("seeded", PROMPTS[4], seeded))
    expected_seeded = _run(plain)["seeded"]

    core = _core(enable_prefix_caching=enable_prefix_caching)
    core.add_request(AddRequest("greedy", PROMPTS[2], _greedy()))
    core.add_request(AddRequest("seeded", PROMPTS[4], seeded))
    core.add_request(AddRequest("other", PROMPTS[0], _greedy()))
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if step == 6:
            core.pause(["greedy", "seeded"])
        if step == 12:
            assert not outputs.get("greedy") or len(outputs["greedy"]) < 24
            core.resume(["greedy", "seeded"])
        if not core.has_unfinished_requests():
            break
        result = core.step()
        for output in result.outputs:
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        if 6 <= step < 12:
            assert {o.request_id for o in result.outputs} <= {"other"}
            assert result.stats.num_paused == 2
    assert outputs["greedy"] == reference[2]
    assert outputs["other"] == reference[0]
    assert outputs["seeded"] == expected_seeded


def test_one_token_prefill_chunks_count_as_prefill() -> None:
    # A budget of 4 splits the 5-token prompt into chunks of 4 and 1; [11] is one token.
    core = _core(budget=4, enable_prefix_caching=False)
    assert core.add_request(AddRequest("chunked", [5, 6, 7, 8, 9], _greedy(2))) is None
    counts = []
    while core.has_unfinished_requests():
        stats = core.step().stats
        counts.append((stats.num_scheduled_tokens, stats.num_prefill_tokens))
    assert counts == [(4, 4), (1, 1), (1, 0)]
    assert core.add_request(AddRequest("single", [11], _greedy(2))) is None
    counts = []
    while core.has_unfinished_requests():
        stats = core.step().stats
        counts.append((stats.num_scheduled_tokens, stats.num_prefill_tokens))
    assert counts == [(1, 1), (1, 0)]
