"""LoRA adapters in the engine (issue 45): an in-process `EngineCore` against peft.

The reference of every adapter is peft's merged model (``merge_and_unload``) in float32:
greedy tokens equal to its ``generate()`` and each token's logprob within `LOGPROB_TOL`,
with adapters and the base model mixed in one batch, under chunked prefill and
preemption, on the engine's own decoder (SmolLM2, the default model's family) and on
transformers' modules (Qwen2: q/k/v biases, another family). Then the engine's rules: the
prefix cache never shares blocks across adapters, ``--max-loras`` bounds the adapters of
the running batch, ``--max-cpu-loras`` those in memory, and requests whose adapter cannot
run end with an error while the others go on.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.support.architectures import save_for_serving
from tests.support.lora import greedy_reference, merged_model, save_adapter
from tests.support.tiny_model import save_tiny_model
from trio_llm.config import engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.lora_files import read_adapter
from trio_llm.messages import AddRequest, LoraRef, SamplingParams

pytestmark = pytest.mark.slow

#: Largest |logprob difference| from peft's merged model: the engine adds ``x A^T B^T``
#: to the base product where peft merged ``B A`` into the weight (float32 rounding only).
LOGPROB_TOL = 1e-4
MAX_TOKENS = 6
#: Prompts of 9, 12, 30 and 45 tokens (the last continues the third: a cached prefix).
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253, 5549, 30],
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308],
    list(range(100, 130)),
    list(range(100, 130)) + list(range(700, 715)),
]


def _ref(name: str, path: Path, model_dir: Path) -> LoraRef:
    config = json.loads((model_dir / "config.json").read_text())
    return LoraRef(name, str(path), read_adapter(path, config, 64).digest)


@pytest.fixture(scope="module")
def smol_adapters(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> list[LoraRef]:
    """Three adapters of SmolLM2: attention only, every projection, rank 16 of the MLP."""
    folder = tmp_path_factory.mktemp("smol-adapters")
    shapes = [
        {"targets": ("q_proj", "v_proj")},
        {},
        {"targets": ("gate_proj", "up_proj", "down_proj", "o_proj"), "rank": 16, "alpha": 8},
    ]
    return [
        _ref(
            f"a{i}", save_adapter(real_model_dir, folder / f"a{i}", seed=i, **shape), real_model_dir
        )
        for i, shape in enumerate(shapes)
    ]


@functools.cache
def _merged(model_dir: Path, adapter: str | None) -> object:
    return merged_model(model_dir, Path(adapter) if adapter else None)


@functools.cache
def _reference(model_dir: Path, adapter: str | None, prompt: tuple[int, ...]) -> tuple:
    return greedy_reference(_merged(model_dir, adapter), list(prompt), MAX_TOKENS)


def _run(core: EngineCore, requests: list[tuple[list[int], LoraRef | None]]) -> dict[str, tuple]:
    """Add every request at once and step until all finish: ``{id: (tokens, logprobs)}``."""
    for i, (prompt, lora) in enumerate(requests):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, lora=lora)
        assert core.add_request(AddRequest(f"r{i}", prompt, params)) is None
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    logprobs: dict[str, list[float]] = {f"r{i}": [] for i in range(len(requests))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [entry.logprob for entry in out.logprobs or []]
    return {key: (tokens[key], logprobs[key]) for key in tokens}


def _assert_as_peft(model_dir: Path, requests: list, results: dict[str, tuple]) -> None:
    for i, (prompt, lora) in enumerate(requests):
        want_tokens, want_logprobs = _reference(model_dir, lora and lora.path, tuple(prompt))
        tokens, logprobs = results[f"r{i}"]
        assert tokens == want_tokens, (i, lora)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "chunked-and-preempted"])
def test_adapters_and_the_base_model_mixed_in_one_batch_equal_peft(
    real_model_dir: Path, smol_adapters: list[LoraRef], tight: bool
) -> None:
    cache = {"num_kv_blocks": 8, "max_num_batched_tokens": 16, "max_model_len": 128}
    cache = cache if tight else {}
    config = engine_config(
        str(real_model_dir),
        dtype="float32",
        quantization="none",
        enable_lora=True,
        max_loras=3,
        num_threads=2,
        **cache,
    )
    core = EngineCore.from_config(config)
    assert core.runner.native is not None  # the engine's own decoder
    adapters: list[LoraRef | None] = [None, *smol_adapters]
    # Every prompt under every adapter (the same prompt under two adapters must not share
    # cached blocks), in an order that mixes them in each step.
    prompts = PROMPTS[1:]  # 12, 30 and 45 tokens: chunks of 16, a cached prefix
    requests = [(p, adapters[(i + j) % 4]) for i, p in enumerate(prompts) for j in range(4)]
    preemptions = 0
    original_step = core.step

    def counting_step():
        nonlocal preemptions
        outputs = original_step()
        preemptions += outputs.stats.num_preemptions
        return outputs

    core.step = counting_step  # type: ignore[method-assign]
    results = _run(core, requests)
    _assert_as_peft(real_model_dir, requests, results)
    assert (preemptions > 0) == tight


def test_transformers_modules_of_another_family_equal_peft(
    tmp_path: Path, real_model_dir: Path
) -> None:
    model_dir = save_for_serving("qwen2", tmp_path / "qwen2", real_model_dir, 49152)
    adapters = [
        _ref(f"q{i}", save_adapter(model_dir, tmp_path / f"q{i}", seed=i, rank=4), model_dir)
        for i in range(2)
    ]
    config = engine_config(
        str(model_dir), dtype="float32", enable_lora=True, max_loras=2, num_threads=2
    )
    core = EngineCore.from_config(config)
    assert core.runner.native is None  # transformers' modules, with the hooks
    requests = [(p, [None, *adapters][i % 3]) for i, p in enumerate(PROMPTS[:3] * 2)]
    _assert_as_peft(model_dir, requests, _run(core, requests))


def test_the_gguf_path_applies_adapters_layer_by_layer(
    real_model_dir: Path, smol_adapters: list[LoraRef]
) -> None:
    """The default (GGUF) path: a decode step with adapters leaves the one-call layer for
    the operator-by-operator loop; both give the base model's numbers without adapters."""
    core = EngineCore.from_config(engine_config(enable_lora=True, max_loras=3, num_threads=2))
    assert core.runner.native.one_call
    requests = [(PROMPTS[0], lora) for lora in [None, *smol_adapters]]
    mixed = _run(core, requests)
    core.runner.native.one_call = False
    looped = _run(core, requests)
    for key, (tokens, logprobs) in mixed.items():
        assert tokens == looped[key][0]
        assert max(abs(a - b) for a, b in zip(logprobs, looped[key][1], strict=True)) < 1e-3
    assert len({tuple(tokens) for tokens, _ in mixed.values()}) == 4  # each adapter tells


def test_the_prefix_cache_keys_blocks_by_adapter(
    real_model_dir: Path, smol_adapters: list[LoraRef]
) -> None:
    config = engine_config(
        str(real_model_dir), dtype="float32", quantization="none", enable_lora=True
    )
    core = EngineCore.from_config(config)
    prompt = PROMPTS[3]

    def cached(lora: LoraRef | None) -> int:
        params = SamplingParams(max_tokens=1, lora=lora)
        core.add_request(AddRequest(f"c{id(params)}", prompt, params))
        found = None
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                found = out.num_cached_tokens if found is None else found
        return found

    a0, a1, _ = smol_adapters
    assert cached(a0) == 0
    assert cached(a0) == 32  # its own two full blocks of 16
    assert cached(a1) == 0 and cached(None) == 0
    renamed = LoraRef("other-name", a0.path, a0.digest)  # the same files: the same blocks
    assert cached(renamed) == 32


def test_fifty_adapters_cycle_through_two_places(tmp_path: Path, real_model_dir: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", tokenizer_dir=real_model_dir, vocab_size=49152)
    refs = [
        _ref(f"t{i}", save_adapter(model_dir, tmp_path / f"t{i}", seed=i, rank=2), model_dir)
        for i in range(50)
    ]
    config = engine_config(
        str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2
    )
    core = EngineCore.from_config(config)
    requests = [(PROMPTS[i % 3], ref) for i, ref in enumerate(refs)]
    for i, (prompt, lora) in enumerate(requests):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, lora=lora)
        core.add_request(AddRequest(f"r{i}", prompt, params))
    results: dict[str, list[int]] = {f"r{i}": [] for i in range(50)}
    most = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None
            results[out.request_id] += out.new_token_ids
        running = {r.params.lora.digest for r in core.scheduler.running}
        most = max(most, len(running))
        assert len(core.adapters) <= 2
    assert most == 2  # the two places were used, never more
    for i, (prompt, lora) in enumerate(requests):
        assert results[f"r{i}"] == _reference(model_dir, lora.path, tuple(prompt))[0]


def test_a_request_whose_adapter_cannot_run_ends_alone(
    tmp_path: Path, real_model_dir: Path, smol_adapters: list[LoraRef]
) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", tokenizer_dir=real_model_dir, vocab_size=49152)
    changed = tmp_path / "changed"
    ref = _ref("c", save_adapter(model_dir, changed, seed=5, rank=2), model_dir)
    off = EngineCore.from_config(engine_config(str(model_dir), dtype="float32"))
    refused = off.add_request(AddRequest("x", PROMPTS[0], SamplingParams(lora=ref)))
    assert refused is not None and "--enable-lora" in refused.error
    on = EngineCore.from_config(engine_config(str(model_dir), dtype="float32", enable_lora=True))
    save_adapter(model_dir, changed, seed=6, rank=2)  # the files change after the check
    refused = on.add_request(AddRequest("y", PROMPTS[0], SamplingParams(lora=ref)))
    assert refused is not None and "changed since it was loaded" in refused.error
    smol = smol_adapters[0]  # an adapter of another base model (SmolLM2's shapes)
    refused = on.add_request(AddRequest("z", PROMPTS[0], SamplingParams(lora=smol)))
    assert refused is not None and "another base model" in refused.error
    assert _run(on, [(PROMPTS[0], None)])["r0"][0]  # the engine serves on
