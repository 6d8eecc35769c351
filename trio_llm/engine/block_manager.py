"""Allocation of fixed-size KV cache blocks to requests."""

from __future__ import annotations

from collections import deque

from trio_llm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class BlockManager:
    """Hands out KV block ids from a free list and records them in each request's block table.

    A request holding ``n`` tokens in the cache owns ``ceil(n / block_size)`` blocks; block
    ``i`` of its table holds positions ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks owned by no request."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks ``request`` needs so its table covers ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """True when the free list can cover ``num_tokens`` tokens of ``request``."""
        return self.num_blocks_needed(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow ``request.block_table`` to cover ``num_tokens`` tokens.

        Raises:
            RuntimeError: not enough free blocks (call `can_allocate` first).
        """
        needed = self.num_blocks_needed(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} KV blocks, {len(self._free)} free")
        for _ in range(needed):
            request.block_table.append(self._free.popleft())

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the free list and clear its table."""
        self._free.extend(request.block_table)
        request.block_table = []

    def slot(self, request: Request, position: int) -> int:
        """Flat KV cache slot of token ``position`` of ``request``."""
        return slot_of(request.block_table, position, self.block_size)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat KV cache slot of token ``position`` in a sequence with ``block_table``."""
    return block_table[position // block_size] * block_size + position % block_size
