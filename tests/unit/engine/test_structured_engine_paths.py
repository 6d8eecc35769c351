"""Constrained outputs through the engine's other paths: preemption (the request is
recomputed, its matcher keeps its place), prefix-cache hits, and many samples of one
prompt. Each run is compared with a run on a cache with room for everything: same
tokens, and every output valid."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams, StructuredOutput
from trio_llm.model_files.loader import load_model

#: Runs engine cores in this process: the slow tier.
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}
#: A prompt of several blocks, shared by every request (prefix-cache hits after the first).
PROMPT = list(range(1, 50))
NUM_REQUESTS = 12


def _core(model_dir: Path, num_kv_blocks: int, prefix_caching: bool) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=160),
        cache=CacheConfig(
            block_size=4, num_kv_blocks=num_kv_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=160),
    )
    return EngineCore(load_model(model_dir, "float32", "sdpa"), config, str(model_dir))


def _run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, str], int, int]:
    """Every request at once: tokens and finish_reason per request, preemptions, cached
    prompt tokens."""
    for i in range(NUM_REQUESTS):
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=80,
            structured_output=StructuredOutput("json", json.dumps(SCHEMA)),
        )
        assert core.add_request(AddRequest(f"r{i}", PROMPT, params)) is None
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(NUM_REQUESTS)}
    finish: dict[str, str] = {}
    preemptions = cached = 0
    while core.has_unfinished_requests():
        result = core.step()
        preemptions += result.stats.num_preemptions
        cached += result.stats.prefix_cache_hits
        for output in result.outputs:
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                finish[output.request_id] = output.finish_reason
    return tokens, finish, preemptions, cached


@pytest.fixture(scope="module")
def roomy(tiny_model_dir: Path) -> dict[str, list[int]]:
    """The outputs with room for every request and no prefix cache."""
    tokens, finish, preemptions, _ = _run(_core(tiny_model_dir, 1024, prefix_caching=False))
    assert preemptions == 0
    assert set(finish.values()) == {"stop"}
    return tokens


def _check_valid(tokens: dict[str, list[int]], smol_tokenizer) -> None:
    for request_tokens in tokens.values():
        jsonschema.validate(json.loads(smol_tokenizer.decode(request_tokens)), SCHEMA)


def test_every_sample_of_one_prompt_is_valid(roomy, smol_tokenizer) -> None:
    _check_valid(roomy, smol_tokenizer)
    assert len({tuple(t) for t in roomy.values()}) > 1  # the seeds give different samples


def test_preempted_constrained_requests_resume_where_they_were(
    tiny_model_dir: Path, roomy, smol_tokenizer
) -> None:
    # 12 requests of 49 + up to ~60 tokens need ~330 blocks of 4; 60 blocks (one request
    # of max_model_len 160 needs 40) force
    # preemption and recompute, over and over.
    tokens, finish, preemptions, _ = _run(_core(tiny_model_dir, 60, prefix_caching=False))
    assert preemptions > 0
    assert set(finish.values()) == {"stop"}
    assert tokens == roomy
    _check_valid(tokens, smol_tokenizer)


def test_prefix_cache_hits_change_nothing(tiny_model_dir: Path, roomy, smol_tokenizer) -> None:
    core = _core(tiny_model_dir, 1024, prefix_caching=True)
    tokens, finish, _, _ = _run(core)
    again, _, _, hits = _run(core)  # the prompt is cached now
    assert hits >= NUM_REQUESTS * 40
    assert tokens == roomy
    assert again == roomy
    assert set(finish.values()) == {"stop"}


def test_masks_match_llguidances_own_masking(real_model_dir: Path, smol_tokenizer) -> None:
    """`apply_masks` unpacks llguidance's bitmask itself; its result must equal
    llguidance's torch kernel on the same logits (the reference)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # its torch.jit.script kernel warns on this torch
        warnings.simplefilter("ignore", DeprecationWarning)
        import llguidance.torch

    from trio_llm.engine.grammar_compiler import GrammarCompiler
    from trio_llm.engine.grammar_masks import apply_masks

    vocab = 49152
    grammars = GrammarCompiler(real_model_dir, vocab, frozenset({2}))
    specs = [
        StructuredOutput("json", json.dumps(SCHEMA)),
        StructuredOutput("regex", "[a-f]{2,5}@[0-9]+"),
        StructuredOutput("choice", json.dumps(["alpha", "beta"])),
    ]
    matchers = [grammars.matcher(spec) for spec in specs]
    # Move two of them off their start: a mask in the middle of an output.
    for matcher, prefix in zip(matchers, ['{"name":"ab', "cafe"], strict=False):
        assert matcher.consume_tokens(smol_tokenizer.encode(prefix, add_special_tokens=False))
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    rows = [4, 0, 2]  # constrained rows, in no particular order; rows 1 and 3 are free
    ours = logits.clone()
    apply_masks(ours, list(zip(rows, matchers, strict=True)))
    reference = logits.clone()
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab)
    for index, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, index)
    constrained = reference[rows]
    llguidance.torch.apply_token_bitmask_inplace(constrained, bitmask)
    reference[rows] = constrained
    assert torch.equal(ours, reference)
    assert torch.isinf(ours[2]).sum() > vocab - 100  # "alpha" or "beta": a few tokens left
