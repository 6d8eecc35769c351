"""KV block allocation and slot arithmetic."""

from __future__ import annotations

import pytest
import torch

from trio_llm.engine.block_manager import BlockManager
from trio_llm.engine.kv_cache import context_slots
from trio_llm.engine.request import NO_BLOCK, Request
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
    assert context_slots(torch.tensor(table), 6, manager.block_size).tolist() == [
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
    """Admit ``request`` as the scheduler does, pretend its prompt was computed; the
    blocks it found cached (its only group's)."""
    hit = manager.lookup(request)
    assert manager.can_take(request, hit, request.num_tokens)
    manager.take(request, hit)
    hits = list(hit.tables[0])
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
    assert manager.lookup(_prompt([0, 2, 3, 4, 5, 6, 7, 8, 9])).num_blocks == 0
    # The last token is always computed, so an identical 8-token prompt hits 1 block.
    assert manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7, 8])).num_blocks == 1
    assert manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])).num_blocks == 2


def test_prompt_logprobs_requests_and_a_disabled_cache_get_no_hits() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    _compute(manager, _prompt(list(range(12))))
    assert manager.lookup(_prompt(list(range(12)), prompt_logprobs=0)).num_blocks == 0
    disabled = BlockManager(num_blocks=16, block_size=4)
    _compute(disabled, _prompt(list(range(12))))
    assert disabled.lookup(_prompt(list(range(12)))).num_blocks == 0
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
    assert manager.lookup(_prompt([1, 2, 3, 4, 5, 6, 7])).num_blocks == 2  # the prefix survived


def test_reviving_a_free_cached_block_counts_against_the_free_list() -> None:
    manager = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    first = _prompt([1, 2, 3, 4, 5])
    _compute(manager, first)
    manager.free(first)
    second = _prompt([1, 2, 3, 4, 5, 6, 7, 8])
    hits = manager.lookup(second)
    assert hits.num_blocks == 2
    # 8 tokens need 4 blocks: 2 revived + 2 fresh, but only 1 block is free besides them.
    assert not manager.can_take(second, hits, 8)
    assert manager.can_take(second, hits, 6)


# ---------------------------------------------------------------- sliding-window groups


def _windowed(num_blocks: int = 32, caching: bool = True) -> BlockManager:
    """Group 0 full attention, group 1 a 6-token window, blocks of 4 tokens."""
    return BlockManager(num_blocks, 4, enable_prefix_caching=caching, windows=(None, 6))


def _advance(manager: BlockManager, request: Request, num_tokens: int) -> None:
    """Compute ``request`` up to ``num_tokens`` as a scheduler step would."""
    manager.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    manager.cache_full_blocks(request)
    manager.release_behind_window(request)


def test_a_window_group_frees_the_blocks_behind_its_window() -> None:
    manager = _windowed()
    request = _prompt(list(range(30)))
    _advance(manager, request, 16)
    # The token at position 16 sees positions 11..16: blocks 2 (8..11) onwards.
    full, window = request.block_tables
    assert len(full) == 4 and NO_BLOCK not in full
    assert window[:2] == [NO_BLOCK, NO_BLOCK] and NO_BLOCK not in window[2:]
    assert manager.num_free_blocks == 32 - 4 - 2
    _advance(manager, request, 30)
    # Position 30 sees 25..30: blocks 6 and 7 (24..31) only.
    assert request.block_tables[1][:6] == [NO_BLOCK] * 6
    assert manager.num_free_blocks == 32 - 8 - 2
    manager.free(request)
    assert manager.num_free_blocks == 32 and request.block_tables == [[], []]


def test_allocation_counts_every_group() -> None:
    manager = _windowed(num_blocks=5)
    request = _prompt(list(range(12)))
    assert manager.num_blocks_needed(request, 12) == 6  # 3 blocks in each group
    assert not manager.can_allocate(request, 12)
    assert manager.can_allocate(request, 8)


def test_a_prefix_hit_needs_only_the_window_in_a_window_group() -> None:
    manager = _windowed()
    first = _prompt(list(range(30)))
    _advance(manager, first, 30)
    manager.free(first)  # cached blocks stay: the full group's 7, the window group's 2
    hit = manager.lookup(_prompt([*range(30), 99]))
    # 7 full blocks (28 tokens); the token at 28 sees 23..28: window blocks 5 and 6, both
    # cached (block 5 was released behind the window, but kept its key).
    assert hit.num_blocks == 7
    full, window = hit.tables
    assert len(full) == 7 and NO_BLOCK not in full
    assert window[:5] == (NO_BLOCK,) * 5 and NO_BLOCK not in window[5:]


def test_a_prefix_hit_stops_where_the_window_group_lost_a_block() -> None:
    manager = _windowed(num_blocks=16)
    first = _prompt(list(range(30)))
    _advance(manager, first, 16)
    _advance(manager, first, 30)
    released = list(first.block_tables[1])  # NO_BLOCK behind the window
    manager.free(first)
    # Free blocks are evicted least recently freed first: the window group's blocks 1 and
    # 0 (released after the first step), then 5 and 4 (after the second).
    manager.allocate(_prompt([500 + i for i in range(8)]), 8)  # 2 blocks in each group
    hit = manager.lookup(_prompt([*range(30), 99]))
    # 28 tokens would need window blocks 5 and 6, 24 tokens blocks 4 and 5, 20 tokens 3
    # and 4; 16 tokens need blocks 2 and 3, which survived.
    assert hit.num_blocks == 4
    full, window = hit.tables
    assert len(full) == 4 and NO_BLOCK not in full
    assert window[:2] == (NO_BLOCK, NO_BLOCK) and len(window) == 4
    assert NO_BLOCK not in window[2:]
    assert released.count(NO_BLOCK) == 6
