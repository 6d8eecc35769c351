"""The prefix cache's tier on disk (issue 44), with engine cores in this process: a prompt's
blocks written by one engine are read back by a new one (a restart) and give the same
tokens; salts keep requests apart; a corrupted file is refused and computed again."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.support.architectures import build_model, engine_copy
from tests.support.tiny_model import build_tiny_model
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.core import EngineCore
from trio_llm.engine.prefix_tier import PrefixTier
from trio_llm.messages import AddRequest, SamplingParams

#: Runs engine cores in this process (a real forward pass per step): the slow tier.
pytestmark = pytest.mark.slow

BLOCK = 4
PROMPT = list(range(30, 71))  # 41 tokens: 10 full blocks a later request can find


def _engine(folder: Path, architecture: str | None = None) -> tuple[EngineCore, PrefixTier]:
    """A tiny random Llama (or another architecture of `tests.support.architectures`)
    with the tier in ``folder``."""
    if architecture is None:
        model = build_tiny_model(seed=0)
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model = engine_copy(build_model(architecture), ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=128, prefix_cache_dir=str(folder)),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )
    core = EngineCore(model, config, "tiny")
    tier = PrefixTier.open(core, config)
    assert tier is not None
    return core, tier


def _generate(
    core: EngineCore, tier: PrefixTier, request_id: str, salt: str | None = None
) -> tuple[list[int], int]:
    """Greedy tokens of `PROMPT` through the tier as the engine loop drives it, and how
    many prompt tokens came from the cache."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt)
    message = AddRequest(request_id, PROMPT, params)
    trio.run(tier.load, message)
    assert core.add_request(message) is None
    tokens: list[int] = []
    cached = None
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens += output.new_token_ids
            if output.num_cached_tokens is not None:
                cached = output.num_cached_tokens
        tier.after_step()
    tier.disk.flush()
    return tokens, cached or 0


def test_a_restarted_engine_reads_the_prompt_from_disk_and_answers_the_same(
    tmp_path: Path,
) -> None:
    first, first_tier = _engine(tmp_path)
    cold, cold_cached = _generate(first, first_tier, "cold")
    assert cold_cached == 0
    assert first_tier.counters.bytes_written > 0
    # Every full block computed: the prompt's and those its output filled.
    full = (len(PROMPT) + 6 - 1) // BLOCK
    assert len(list(first_tier.disk.folder.glob("*.kv"))) == full
    first_tier.close()
    found = (len(PROMPT) - 1) // BLOCK  # what a request of this prompt can take

    second, second_tier = _engine(tmp_path)  # a restart: an empty KV cache
    warm, warm_cached = _generate(second, second_tier, "warm")
    assert warm == cold
    assert warm_cached == found * BLOCK
    assert second_tier.counters.hits == found
    assert second_tier.counters.refused == 0

    # Another salt finds nothing, on disk or in memory, and still answers the same.
    salted, salted_cached = _generate(second, second_tier, "salted", salt="tenant-b")
    assert (salted, salted_cached) == (cold, 0)
    assert second_tier.counters.hits == found
    second_tier.close()


def test_a_corrupted_block_file_is_refused_removed_and_computed_again(tmp_path: Path) -> None:
    first, first_tier = _engine(tmp_path)
    cold, _ = _generate(first, first_tier, "cold")
    first_tier.close()
    files = sorted(first_tier.disk.folder.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    # Flip one payload byte of the fourth block written (the prompt's fourth block).
    fourth = files[3]
    data = bytearray(fourth.read_bytes())
    data[-1] ^= 0xFF
    fourth.write_bytes(bytes(data))

    second, second_tier = _engine(tmp_path)
    warm, warm_cached = _generate(second, second_tier, "warm")
    assert warm == cold
    assert warm_cached == 3 * BLOCK  # the chain stops at the refused block
    assert second_tier.counters.refused == 1
    assert second_tier.counters.hits == 3
    # Computed again, and written again by the writer.
    assert fourth.exists()
    second_tier.close()


def test_a_model_with_sliding_window_layers_reads_its_prefix_back(tmp_path: Path) -> None:
    """Gemma 3's layout (sliding-window and full-attention KV cache groups): each group's
    blocks are written, and a restart reads the full group's chain and the window group's
    blocks inside its window, with the same tokens."""
    first, first_tier = _engine(tmp_path, "gemma3_text")
    assert len(first.kv_groups.windows) > 1 and None in first.kv_groups.windows
    cold, _ = _generate(first, first_tier, "cold")
    first_tier.close()
    second, second_tier = _engine(tmp_path, "gemma3_text")
    warm, warm_cached = _generate(second, second_tier, "warm")
    assert warm == cold
    assert warm_cached == (len(PROMPT) - 1) // BLOCK * BLOCK
    assert second_tier.counters.refused == 0
    second_tier.close()
