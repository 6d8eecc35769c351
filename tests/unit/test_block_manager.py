"""KV block allocation and slot arithmetic."""

from __future__ import annotations

import pytest

from trio_llm.engine.block_manager import BlockManager
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
    assert manager.usage == pytest.approx(0.75)


def test_slots_follow_the_block_table() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first, second = _request(1), _request(2)
    manager.allocate(first, 4)
    manager.allocate(second, 4)
    manager.allocate(first, 6)
    table = first.block_table
    assert [manager.slot(first, p) for p in range(6)] == [
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
