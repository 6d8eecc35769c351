"""The GPU's paths: CUDA graphs for decode steps (`trio_llm.engine.cuda_graphs`), batched
prefill attention and sampling on the device.

The padded path itself is checked against generate() in the conformance suite
(``test_gpu_step_paths_*``). Here: the buckets, which models qualify, the flag, and — on
a machine with a GPU only — that captured graphs give the eager engine's tokens and that
sampling on the device keeps seeds and truncation.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.architectures import build_model, engine_copy
from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.core import EngineCore
from trio_llm.engine.cuda_graphs import DecodeGraphs, batch_buckets, column_buckets
from trio_llm.engine.request import Request
from trio_llm.engine.sampler import Sampler
from trio_llm.messages import AddRequest, SamplingParams


def test_batch_buckets_cover_every_size_up_to_max_num_seqs() -> None:
    assert batch_buckets(1) == [1, 2, 4]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 24]
    buckets = batch_buckets(256)
    assert buckets[-1] == 256 and len(buckets) == 35
    for size in range(1, 257):
        fit = next(b for b in buckets if b >= size)
        assert fit - size < 8  # at most 7 padding rows


def test_column_buckets_double_up_to_the_widest_table() -> None:
    assert column_buckets(3) == [3]
    assert column_buckets(4) == [4]
    assert column_buckets(29) == [4, 8, 16, 29]
    assert column_buckets(512) == [4, 8, 16, 32, 64, 128, 256, 512]


def _core(name: str, model_impl: str = "auto", device: str = "cpu", **model: object) -> EngineCore:
    net = engine_copy(build_model(name), ATTENTION_NAME).to(device)
    config = EngineConfig(
        model=ModelConfig(
            model=name, max_model_len=128, model_impl=model_impl, device=device, **model
        ),
        cache=CacheConfig(block_size=4, num_kv_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    return EngineCore(net, config, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "model_impl", "reason"),
    [
        ("llama", "auto", None),
        ("llama", "transformers", "engine's own forward pass"),
        ("llama_dynamic_rope", "auto", "rope_type 'dynamic'"),
    ],
)
def test_which_models_qualify(name: str, model_impl: str, reason: str | None) -> None:
    core = _core(name, model_impl)
    why = DecodeGraphs.unsupported(core.runner)
    assert (why is None) if reason is None else (reason in why)
    # On the CPU no graph is ever made, whatever the model.
    assert core.runner.graphs is None
    assert core.runner.batched_prefill is False


def test_enforce_eager_is_vllms_flag() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).engine.model.enforce_eager is False
    args = parser.parse_args(["serve", "--enforce-eager"])
    assert config_from_args(args).engine.model.enforce_eager is True


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert core.add_request(AddRequest(f"r{i}", prompt, params)) is None
    tokens: list[list[int]] = [[] for _ in prompts]
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            tokens[int(output.request_id[1:])] += output.new_token_ids
    return tokens


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_give_the_eager_tokens() -> None:
    """On a GPU, in float32 (the tiny model's greedy tokens do not flip on rounding):
    the engine with its captured decode graphs and batched prefill attention produces
    the tokens of the same engine run eagerly with one attention call per chunk, with
    batches of several sizes and contexts that cross block-width buckets."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 9, 17, 30, 3)]
    graphed = _core("llama", device="cuda")
    plain = _core("llama", device="cuda", enforce_eager=True)
    assert graphed.runner.graphs is not None and plain.runner.graphs is None
    assert graphed.runner.batched_prefill
    plain.runner.batched_prefill = False
    assert _greedy(graphed, prompts, 40) == _greedy(plain, prompts, 40)
    assert graphed.runner.graphs.num_captured >= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sampling on a GPU needs one")
def test_sampling_on_the_gpu_keeps_seeds_and_truncation() -> None:
    """The sampler on CUDA logits: a seeded row draws what it draws on the CPU (its own
    generator, on the CPU), and unseeded rows stay inside their top-k set."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0)) * 3
    seeded = [
        Request(f"s{i}", [1], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i))
        for i in range(8)
    ]
    unseeded = [Request(f"u{i}", [1], SamplingParams(temperature=1.0, top_k=5)) for i in range(8)]
    on_cpu = Sampler(seed=1)(logits[:8].clone(), seeded).token_ids
    seeded_again = [
        Request(f"s{i}", [1], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i))
        for i in range(8)
    ]
    on_gpu = Sampler(seed=1)(logits.clone().cuda(), seeded_again + unseeded)
    assert on_gpu.token_ids[:8] == on_cpu
    top5 = logits[8:].topk(5).indices.tolist()
    assert all(t in top for t, top in zip(on_gpu.token_ids[8:], top5, strict=True))
