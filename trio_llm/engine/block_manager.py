"""Allocation of fixed-size KV cache blocks to requests, with automatic prefix caching.

Every block is either owned by one or more requests (its reference count) or free. With
prefix caching on, a *full* block whose keys/values are computed is registered under a
key derived from its token content: ``key_i = sha256(key_{i-1} || tokens of block i)``
(block 0 chains from the empty string), so a key names the whole prefix up to the end of
the block, not just the block's own 16 tokens. A new request whose leading blocks have
registered keys takes those blocks (reference count + 1) instead of computing them.

Freed blocks keep their key and stay reusable until the allocator needs a fresh block:
free blocks are handed out least recently freed first (LRU eviction), and a request's
blocks are freed last block first, so the tail of a sequence is evicted before its
prefix. This is the policy of vLLM V1's KV cache manager; the key is a cryptographic hash
so that one client cannot craft a prompt whose blocks collide with another's.
"""

from __future__ import annotations

import hashlib
from array import array

from trio_llm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Prefix-cache key of a full block: 32 bytes of sha256 over the parent key and tokens.

    Args:
        parent: the key of the previous block, ``b""`` for block 0.
        tokens: the block's token ids (exactly ``block_size`` of them).
    """
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Hands out KV block ids and records them in each request's block table.

    A request holding ``n`` tokens in the cache owns ``ceil(n / block_size)`` blocks; block
    ``i`` of its table holds positions ``[i * block_size, (i + 1) * block_size)``.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse computed full blocks across requests (see the module
            docstring). Off: every request computes every token, as before.

    Attributes:
        num_queried_tokens: prompt tokens of requests admitted with a cache lookup (a
            running total; vLLM's ``prefix_cache_queries``).
        num_hit_tokens: of those, tokens found in the cache (``prefix_cache_hits``).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._ref_count = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # key -> block id holding that prefix block
        # Free blocks in eviction order (front first); a dict keeps insertion order and
        # removes a block from the middle in O(1) when a cache hit revives it.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks owned by no request (cached ones included: they can be evicted)."""
        return len(self._free)

    # ------------------------------------------------------------ plain allocation

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks ``request`` needs so its table covers ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """True when the free list can cover ``num_tokens`` tokens of ``request``."""
        return self.num_blocks_needed(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow ``request.block_table`` with fresh blocks to cover ``num_tokens`` tokens.

        A fresh block that still held a cached prefix block loses its key (eviction).

        Raises:
            RuntimeError: not enough free blocks (call `can_allocate` first).
        """
        needed = self.num_blocks_needed(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} KV blocks, {len(self._free)} free")
        for _ in range(needed):
            block = next(iter(self._free))
            del self._free[block]
            key = self._key_of[block]
            if key is not None:
                self._key_of[block] = None
                del self._cached[key]
            self._ref_count[block] = 1
            request.block_table.append(block)

    def free(self, request: Request) -> None:
        """Drop ``request``'s hold on its blocks (last block first) and clear its table."""
        for block in reversed(request.block_table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None
        request.block_table = []
        request.num_registered_blocks = 0

    # ------------------------------------------------------------ prefix caching

    def lookup(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of ``request``'s tokens (not yet taken).

        Only full blocks count, and never the last token: at least one token must be
        computed to produce the next token's logits. Requests asking for prompt logprobs
        get no hits (those need the hidden states of every prompt position), nor do
        requests that already hold blocks.
        """
        if (
            not self.enable_prefix_caching
            or request.block_table
            or request.params.prompt_logprobs is not None
        ):
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        hits = []
        for index in range(num_full):
            block = self._cached.get(self._key(request, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_take(self, request: Request, hits: list[int], num_tokens: int) -> bool:
        """True when ``hits`` plus fresh blocks can cover ``num_tokens`` of ``request``."""
        revived = sum(1 for block in hits if self._ref_count[block] == 0)
        fresh = cdiv(num_tokens, self.block_size) - len(hits)
        return fresh <= len(self._free) - revived

    def take(self, request: Request, hits: list[int]) -> int:
        """Give ``request`` the cached blocks ``hits`` as the start of its table.

        Counts the lookup in `num_queried_tokens` / `num_hit_tokens` (only when prefix
        caching is on) and sets ``request.num_computed_tokens``.

        Returns:
            The number of tokens found in the cache (``len(hits) * block_size``).
        """
        for block in hits:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1
        request.block_table = list(hits)
        num_hit = len(hits) * self.block_size
        request.num_computed_tokens = num_hit
        if self.enable_prefix_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit
        return num_hit

    def cache_full_blocks(self, request: Request) -> None:
        """Register ``request``'s blocks that are full and computed under their keys.

        Call after ``request.num_computed_tokens`` advanced. A block whose prefix is
        already cached in another block (two identical prompts prefilled at once) stays
        unregistered and is freed normally.
        """
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for index in range(request.num_registered_blocks, num_full):
            block = request.block_table[index]
            key = self._key(request, index)
            if self._key_of[block] is None and key not in self._cached:
                self._cached[key] = block
                self._key_of[block] = key
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (the blocks stay where they are); counters are kept."""
        self._cached.clear()
        self._key_of = [None] * self.num_blocks

    def _key(self, request: Request, index: int) -> bytes:
        """Key of full block ``index`` of ``request``, computed once and kept on it."""
        keys = request.block_keys
        bs = self.block_size
        while len(keys) <= index:
            i = len(keys)
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            keys.append(block_key(keys[-1] if keys else b"", tokens))
        return keys[index]


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat KV cache slot of token ``position`` in a sequence with ``block_table``."""
    return block_table[position // block_size] * block_size + position % block_size
