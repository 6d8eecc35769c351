"""KV block allocation and slot arithmetic."""

from __future__ import annotations

import pytest

from trio_llm.engine.block_manager import BlockManager, slot_of
from trio_llm.engine.request import Request
from trio_llm.messages import SamplingParams


def _request(n: int = 1) -> Request:
    return Request(f"r{n}", [1] * n, SamplingParams())


def test_allocation_covers_tokens_block_by_block() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    request = _request()
    manager.allocate(request, 5)  # needs ceil(5 / 4) = 2 blocks
    assert len(request.block_table) == 2
    assert manager.num_free_blocks == 2
    manager.allocate(request, 8)  # still 2 blocks
    assert len(request.block_table) == 2
    manager.allocate(request, 9)
    assert len(request.block_table) == 3
    assert 1.0 - manager.num_free_blocks / manager.num_blocks == pytest.approx(0.75)


def test_slots_follow_the_block_table() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first, second = _request(1), _request(2)
    manager.allocate(first, 4)
    manager.allocate(second, 4)
    manager.allocate(first, 6)
    table = first.block_table
    assert [slot_of(first.block_table, p, manager.block_size) for p in range(6)] == [
        table[0] * 4,
        table[0] * 4 + 1,
        table[0] * 4 + 2,
        table[0] * 4 + 3,
        table[1] * 4,
        table[1] * 4 + 1,
    ]
    assert set(first.block_table).isdisjoint(second.block_table)


def test_over_allocation_raises_and_free_returns_everything() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    request = _request()
    assert not manager.can_allocate(request, 5)
    with pytest.raises(RuntimeError):
        manager.allocate(request, 5)
    manager.allocate(request, 4)
    assert manager.num_free_blocks == 0
    manager.free(request)
    assert request.block_table == []
    assert manager.num_free_blocks == 2


# ---------------------------------------------------------------- prefix caching


def _prompt(tokens: list[int], **params: object) -> Request:
    return Request(f"p{len(tokens)}-{tokens[:1]}", tokens, SamplingParams(**params))


def _compute(manager: BlockManager, request: Request) -> list[int]:
    """Admit ``request`` as the scheduler does, pretend its prompt was computed; hits."""
    hits = manager.lookup(request)
    assert manager.can_take(request, hits, request.num_tokens)
    manager.take(request, hits)
    manager.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return hits


def test_a_shared_prefix_reuses_full_blocks_only() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = _prompt(list(range(10)))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert _compute(manager, first) == []
    second = _prompt([*range(10), 77, 78])
    hits = _compute(manager, second)
    assert hits == first.block_table[:2]  # the partial block is never shared
    assert second.block_table[:2] == hits
    assert second.block_table[2] not in first.block_table
    assert manager.num_hit_tokens == 8
    assert manager.num_queried_tokens == 10 + 12


def test_keys_name_the_whole_prefix_not_just_the_block() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    _compute(manager, _prompt([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: nothing matches.
    assert manager.lookup(_prompt([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    # The last token is always computed, so an identical 8-token prompt hits 1 block.
    assert len(manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7, 8]))) == 1
    assert len(manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9]))) == 2


def test_prompt_logprobs_requests_and_a_disabled_cache_get_no_hits() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    _compute(manager, _prompt(list(range(12))))
    assert manager.lookup(_prompt(list(range(12)), prompt_logprobs=0)) == []
    disabled = BlockManager(num_blocks=16, block_size=4)
    _compute(disabled, _prompt(list(range(12))))
    assert disabled.lookup(_prompt(list(range(12)))) == []
    assert len(disabled._cached) == 0
    assert disabled.num_queried_tokens == disabled.num_hit_tokens == 0


def test_shared_blocks_are_freed_when_the_last_owner_lets_go() -> None:
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = _prompt(list(range(9)))
    _compute(manager, first)  # 3 blocks
    second = _prompt(list(range(9)))
    assert len(_compute(manager, second)) == 2  # shares 2, owns 1 of its own
    assert manager.num_free_blocks == 6 - 4
    manager.free(first)
    assert manager.num_free_blocks == 3  # only first's own last block
    manager.free(second)
    assert manager.num_free_blocks == 6
    # Freed blocks keep their keys: a third request still hits them.
    assert len(_compute(manager, _prompt(list(range(9))))) == 2


def test_fresh_allocations_evict_the_least_recently_freed_tail_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = _prompt([1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 full ones cached
    _compute(manager, first)
    manager.free(first)
    assert len(manager._cached) == 3
    # One fresh block evicts first's last (partial) block, the next one its third block.
    other = _prompt([9, 9])
    manager.allocate(other, 4)
    assert len(manager._cached) == 2
    assert len(manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7]))) == 2  # the prefix survived


def test_reviving_a_free_cached_block_counts_against_the_free_list() -> None:
    manager = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    first = _prompt([1, 2, 3, 4, 5])
    _compute(manager, first)
    manager.free(first)
    second = _prompt([1, 2, 3, 4, 5, 6, 7, 8])
    hits = manager.lookup(second)
    assert len(hits) == 2
    # 8 tokens need 4 blocks: 2 revived + 2 fresh, but only 1 block is free besides them.
    assert not manager.can_take(second, hits, 8)
    assert manager.can_take(second, hits, 6)
