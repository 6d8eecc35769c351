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
prefix (blocks a sliding window left behind were freed earlier, and go first). This is
the policy of vLLM V1's KV cache manager; the key is a cryptographic hash so that one
client cannot craft a prompt whose blocks collide with another's.

KV cache groups (vLLM's hybrid KV cache manager): a model whose layers attend differently
(Gemma 3: 15 layers with a 512-token window, 3 over the whole context) has its layers
split into groups of equal size, each group of one kind; every group has its own block
table per request, all drawn from this one pool (a block id addresses one slot in each of
the group's layers). A sliding-window group needs only the blocks that overlap the window
of the next token: `release_behind_window` frees the others after each step, and a
prefix-cache hit needs, in such a group, only the blocks inside the window before the hit.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from trio_llm.engine.request import NO_BLOCK, Request
from trio_llm.messages import SamplingParams


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


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks a request can start from (`BlockManager.lookup`).

    Attributes:
        num_blocks: leading full blocks of the request found (its first
            ``num_blocks * block_size`` tokens need no computing).
        tables: per group, the block table to start from: ``num_blocks`` entries, with
            ``NO_BLOCK`` behind a sliding window where that group needs no block.
    """

    num_blocks: int
    tables: tuple[tuple[int, ...], ...]


class BlockManager:
    """Hands out KV block ids and records them in each request's block tables.

    A request holding ``n`` tokens in the cache owns ``ceil(n / block_size)`` blocks in
    each full-attention group, fewer in a sliding-window group; block ``i`` of a table
    holds positions ``[i * block_size, (i + 1) * block_size)``.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse computed full blocks across requests (see the module
            docstring). Off: every request computes every token, as before.
        windows: one entry per KV cache group: None for full attention, else the
            group's sliding window in tokens (a query sees itself and ``window - 1``
            tokens before it).

    Attributes:
        num_queried_tokens: prompt tokens of requests admitted with a cache lookup (a
            running total; vLLM's ``prefix_cache_queries``).
        num_hit_tokens: of those, tokens found in the cache (``prefix_cache_hits``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError("windows must name at least one group, each window positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._has_windows = any(w is not None for w in self.windows)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._ref_count = [0] * num_blocks
        self._key_of: list[tuple[int, bytes] | None] = [None] * num_blocks
        # (group, key) -> block id holding that prefix block for that group's layers.
        self._cached: dict[tuple[int, bytes], int] = {}
        # Free blocks in eviction order (front first); a dict keeps insertion order and
        # removes a block from the middle in O(1) when a cache hit revives it.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        #: ``(group, key, block)`` of each block `cache_full_blocks` registered since the
        #: last `take_registered`, when a disk tier reads them (None: not recorded).
        self.registered: list[tuple[int, bytes, int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks owned by no request (cached ones included: they can be evicted)."""
        return len(self._free)

    def _tables(self, request: Request) -> list[list[int]]:
        """``request``'s block tables, one per group (created empty on first use)."""
        if len(request.block_tables) != len(self.windows):
            request.block_tables = [[] for _ in self.windows]
            request.num_registered = [0] * len(self.windows)
        return request.block_tables

    def first_needed_block(self, group: int, num_computed: int) -> int:
        """Index (in a block table) of the first block of ``group`` that the token at
        position ``num_computed`` (the next one to compute) attends to: 0 for full
        attention."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    # ------------------------------------------------------------ plain allocation

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks ``request`` needs so its tables cover ``num_tokens`` tokens."""
        covered = cdiv(num_tokens, self.block_size)
        return sum(max(0, covered - len(table)) for table in self._tables(request))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """True when the free list can cover ``num_tokens`` tokens of ``request``."""
        return self.num_blocks_needed(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow ``request``'s block tables with fresh blocks to cover ``num_tokens`` tokens.

        A fresh block that still held a cached prefix block loses its key (eviction).

        Raises:
            RuntimeError: not enough free blocks (call `can_allocate` first).
        """
        needed = self.num_blocks_needed(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} KV blocks, {len(self._free)} free")
        covered = cdiv(num_tokens, self.block_size)
        for table in self._tables(request):
            while len(table) < covered:
                table.append(self._fresh_block())

    def _fresh_block(self) -> int:
        block = next(iter(self._free))
        del self._free[block]
        key = self._key_of[block]
        if key is not None:
            self._key_of[block] = None
            del self._cached[key]
        self._ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref_count[block] -= 1
        if self._ref_count[block] == 0:
            self._free[block] = None

    def free(self, request: Request) -> None:
        """Drop ``request``'s hold on its blocks and clear its tables. Blocks are freed
        last position first, across the groups alike, so eviction takes a sequence's
        tail before its prefix in every group."""
        tables = self._tables(request)
        for index in range(max(map(len, tables)) - 1, -1, -1):
            for table in tables:
                if index < len(table) and table[index] != NO_BLOCK:
                    self._release(table[index])
        request.block_tables = [[] for _ in self.windows]
        request.num_registered = [0] * len(self.windows)

    def release_behind_window(self, request: Request) -> None:
        """Free the blocks of sliding-window groups that no token from
        ``request.num_computed_tokens`` on attends to (call after the step that computed
        them and after `cache_full_blocks`: a registered block stays reusable)."""
        if not self._has_windows:
            return
        for group, table in enumerate(self._tables(request)):
            first = min(self.first_needed_block(group, request.num_computed_tokens), len(table))
            for index in range(first - 1, -1, -1):
                if table[index] == NO_BLOCK:
                    break  # released by an earlier step, as is everything before it
                self._release(table[index])
                table[index] = NO_BLOCK

    # ------------------------------------------------------------ prefix caching

    def lookup(self, request: Request) -> PrefixHit:
        """The longest cached prefix of ``request``'s tokens that every group can start
        from (not yet taken).

        Only full blocks count, and never the last token: at least one token must be
        computed to produce the next token's logits. Requests asking for prompt logprobs
        get no hits (those need the hidden states of every prompt position), nor do
        requests that already hold blocks. A full-attention group needs every block of
        the prefix, a sliding-window group those inside the window of its next token.
        """
        groups = range(len(self.windows))
        if (
            not self.enable_prefix_caching
            or any(self._tables(request))
            or request.params.prompt_logprobs is not None
        ):
            return PrefixHit(0, tuple(() for _ in groups))
        num_full = (request.num_tokens - 1) // self.block_size
        found: list[list[int | None]] = []
        for group in groups:
            blocks: list[int | None] = []
            for index in range(num_full):
                block = self._cached.get((group, self._key(request, index)))
                if block is None and self.windows[group] is None:
                    break  # a full group needs the whole chain
                blocks.append(block)
            found.append(blocks)
        num_blocks = min(len(blocks) for blocks in found)
        # In a window group, a missing block at index m < num_blocks stops the hit at m
        # unless it lies behind the window of position num_blocks * block_size.
        missing = [[i for i, block in enumerate(blocks) if block is None] for blocks in found]
        while num_blocks > 0:
            for group in groups:
                stop = bisect.bisect_left(missing[group], num_blocks)
                last = missing[group][stop - 1] if stop else -1
                if last >= self.first_needed_block(group, num_blocks * self.block_size):
                    num_blocks = last
                    break
            else:
                break
        tables = []
        for group in groups:
            first = self.first_needed_block(group, num_blocks * self.block_size)
            needed = found[group][first:num_blocks]
            tables.append(
                (NO_BLOCK,) * first + tuple(block for block in needed if block is not None)
            )
        return PrefixHit(num_blocks, tuple(tables))

    def can_take(self, request: Request, hit: PrefixHit, num_tokens: int) -> bool:
        """True when ``hit`` plus fresh blocks can cover ``num_tokens`` of ``request``."""
        taken = [block for table in hit.tables for block in table if block != NO_BLOCK]
        revived = sum(1 for block in set(taken) if self._ref_count[block] == 0)
        fresh = len(self.windows) * cdiv(num_tokens, self.block_size) - sum(
            len(table) for table in hit.tables
        )
        return fresh <= len(self._free) - revived

    def take(self, request: Request, hit: PrefixHit) -> int:
        """Give ``request`` the cached blocks of ``hit`` as the start of its tables.

        Counts the lookup in `num_queried_tokens` / `num_hit_tokens` (only when prefix
        caching is on) and sets ``request.num_computed_tokens``.

        Returns:
            The number of tokens found in the cache (``hit.num_blocks * block_size``).
        """
        self._tables(request)
        for group, table in enumerate(hit.tables):
            for block in table:
                if block == NO_BLOCK:
                    continue
                if self._ref_count[block] == 0:
                    del self._free[block]
                self._ref_count[block] += 1
            request.block_tables[group] = list(table)
            request.num_registered[group] = len(table)
        num_hit = hit.num_blocks * self.block_size
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
        for group, table in enumerate(self._tables(request)):
            for index in range(request.num_registered[group], num_full):
                block = table[index]
                if block == NO_BLOCK:
                    continue
                key = (group, self._key(request, index))
                if self._key_of[block] is None and key not in self._cached:
                    self._cached[key] = block
                    self._key_of[block] = key
                    if self.registered is not None:
                        self.registered.append((group, key[1], block))
            request.num_registered[group] = max(request.num_registered[group], num_full)

    def cached_block(self, group: int, key: bytes) -> int | None:
        """The block holding prefix block ``key`` of ``group``, or None."""
        return self._cached.get((group, key))

    def import_block(self, group: int, key: bytes) -> int | None:
        """A free block to hold prefix block ``key`` of ``group`` (read from elsewhere:
        the disk tier), registered under it and left free, most recently freed: the
        caller writes its keys and values before the next step. None when no block is
        free or ``key`` is cached already.
        """
        if not self._free or (group, key) in self._cached:
            return None
        block = self._fresh_block()
        self._cached[(group, key)] = block
        self._key_of[block] = (group, key)
        self._release(block)
        return block

    def take_registered(self) -> list[tuple[int, bytes, int]]:
        """The ``(group, key, block)`` registered since the last call (see `registered`)."""
        if self.registered is None:
            return []
        taken, self.registered = self.registered, []
        return taken

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
            parent = keys[-1] if keys else key_root(request.params)
            keys.append(block_key(parent, tokens))
        return keys[index]


def key_root(params: SamplingParams) -> bytes:
    """The parent of block 0's key: empty, or a digest of the request's ``cache_salt``
    (vLLM's field) and of its LoRA adapter's files, so requests of different salts or
    adapters never share a block."""
    salt, lora = params.cache_salt, params.lora
    root = b""
    if salt is not None:
        root = hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    if lora is not None:
        root = hashlib.sha256(b"lora\0" + lora.digest.encode("ascii") + b"\0" + root).digest()
    return root


def prefix_keys(token_ids: Sequence[int], block_size: int, params: SamplingParams) -> list[bytes]:
    """The keys of the full blocks a request of ``params`` (its salt and adapter) can find
    in the cache (never its last token: see `BlockManager.lookup`), in order."""
    keys: list[bytes] = []
    parent = key_root(params)
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_key(parent, list(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)
    return keys
