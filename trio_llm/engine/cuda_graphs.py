"""CUDA graphs for decode steps: one launch per step instead of one per operation.

A decode step of a small model on a GPU is bound by the CPU: every layer issues a dozen
kernels from Python, each taking longer to launch than to run. A CUDA graph records the
kernels of one decoder forward pass once and replays them with one call.

A graph has fixed shapes and addresses, so `DecodeGraphs` keeps, per captured shape, a
set of static input buffers and pads each decode-only batch into them:

- the batch size is rounded up to a bucket (`batch_buckets`: 1, 2, 4, then multiples of
  8, as vLLM captures), the padding rows decode token 0 at position 0 with a context of
  one token, and write their keys and values to the KV cache's scratch slot (never in a
  block table), so they touch no request's cache;
- the block-table width (blocks of the longest context) is rounded up to a power of two
  (`column_buckets`); padding columns point at block 0 and are masked.

A graph is captured the first time its ``(batch, columns)`` shape is needed (after one
eager warm-up run on a side stream), in one memory pool shared by all of them, and is
replayed from then on. Batches with a prefill chunk, or larger than `max_num_seqs`, run
eagerly. If a capture fails, the step runs eagerly and no graph is tried again.

``capture=False`` runs the same padded, static-buffer path without graphs: that is how
the CPU tests check the padding and bucketing; the graphs themselves need a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trio_llm.engine.attention_metadata import PagedAttentionMetadata
from trio_llm.engine.kv_cache import KVCache
from trio_llm.engine.native import NativeLlama
from trio_llm.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)

#: The narrowest block-table width captured (blocks of the longest context).
MIN_COLUMNS = 4


class GraphedRunner(Protocol):
    """What `DecodeGraphs` uses of its model runner (`trio_llm.engine.model_runner.ModelRunner`)."""

    kv_cache: KVCache
    device: torch.device
    dtype: torch.dtype
    #: The engine's own forward pass (`trio_llm.engine.native`), or None.
    native: NativeLlama | None
    num_groups: int

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: PagedAttentionMetadata
    ) -> torch.Tensor:
        """The decoder's final hidden states ``[T, hidden]`` of int64 ``[1, T]`` inputs."""
        ...


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8 up
    to the first that holds ``max_num_seqs``."""
    buckets = [1, 2, 4]
    size = 8
    while buckets[-1] < max_num_seqs:
        buckets.append(size)
        size += 8
    return buckets


def column_buckets(max_columns: int) -> list[int]:
    """Block-table widths a graph is captured for: powers of two from `MIN_COLUMNS`, the
    last one ``max_columns`` itself (the widest table a request can have)."""
    buckets = []
    width = MIN_COLUMNS
    while width < max_columns:
        buckets.append(width)
        width *= 2
    return [*buckets, max_columns]


def _bucket(buckets: list[int], size: int) -> int:
    """The smallest bucket holding ``size`` (callers check it fits)."""
    return next(b for b in buckets if b >= size)


@dataclass
class _Graph:
    """The static buffers of one captured shape, and its graph (None: not captured, or
    ``capture=False``)."""

    input_ids: torch.Tensor  # int64 [batch]
    positions: torch.Tensor  # int64 [batch]
    slots: torch.Tensor  # int64 [batch]
    tables: torch.Tensor  # int64 [batch, columns]
    lengths: torch.Tensor  # int64 [batch]
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # [batch, hidden], written by each replay
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Runs decode-only batches of a model runner through padded static buffers, replayed
    from CUDA graphs (module docstring).

    Args:
        runner: the model runner; its KV cache must have one group, its layers no sliding
            window or softcap, and its decoder the engine's own (`unsupported` says why
            not).
        max_num_seqs: the largest batch taken.
        capture: record CUDA graphs (the runner's device must be a GPU); False runs the
            padded path eagerly.
    """

    def __init__(self, runner: GraphedRunner, max_num_seqs: int, capture: bool) -> None:
        self.runner = runner
        self.kv_cache = runner.kv_cache
        self.device = runner.device
        self.capture = capture
        self.max_num_seqs = max_num_seqs
        self.batch_sizes = batch_buckets(max_num_seqs)
        # No block table is wider than the pool.
        self.widths = column_buckets(self.kv_cache.num_blocks)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        #: Captures done, and replays (or eager padded runs) served.
        self.num_captured = 0
        self.num_runs = 0

    @staticmethod
    def unsupported(runner: GraphedRunner) -> str | None:
        """Why ``runner``'s decode steps cannot be captured, or None when they can."""
        if runner.native is None:
            return "CUDA graphs need the engine's own forward pass (--model-impl trio_llm)"
        rope_type = getattr(runner.native.rotary_emb, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            # These pick their frequencies from the step's longest position in Python.
            return f"CUDA graphs cannot capture rope_type {rope_type!r}"
        if runner.num_groups != 1:
            return "CUDA graphs need a KV cache of one group"
        for spec in runner.kv_cache.layers:
            if spec.sliding_window is not None or spec.softcap is not None:
                return "CUDA graphs need layers without sliding window or softcap"
        return None

    def takes(self, step: StepInputs) -> bool:
        """Whether ``step`` runs here: decodes only, at most `max_num_seqs` of them."""
        attention = step.attention
        return not attention.prefills and 0 < attention.num_decode <= self.max_num_seqs

    def run(self, step: StepInputs) -> torch.Tensor:
        """The final hidden states ``[num_decode, hidden]`` of a decode-only step (a view
        of a static buffer: valid until the next run)."""
        attention = step.attention
        n = attention.num_decode
        if attention.decode_blocks is None or attention.decode_lengths is None:
            raise RuntimeError("a CUDA graph runs decode steps only")
        blocks = attention.decode_blocks[0]
        key = (_bucket(self.batch_sizes, n), _bucket(self.widths, blocks.shape[1]))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._new_entry(*key)
        entry.input_ids[:n].copy_(step.input_ids)
        entry.input_ids[n:].zero_()
        entry.positions[:n].copy_(step.positions)
        entry.positions[n:].zero_()
        entry.slots[:n].copy_(attention.slot_mapping[0])
        entry.slots[n:].fill_(self.kv_cache.scratch_slot)
        entry.tables.zero_()
        entry.tables[:n, : blocks.shape[1]].copy_(blocks)
        entry.lengths[:n].copy_(attention.decode_lengths)
        entry.lengths[n:].fill_(1)
        self.num_runs += 1
        if entry.graph is None and self.capture:
            self._capture(entry, key)
        if entry.graph is not None:
            entry.graph.replay()
            if entry.hidden is None:
                raise RuntimeError("a captured CUDA graph has no output buffer")
            return entry.hidden[:n]
        return self._forward(entry)[:n]

    def _new_entry(self, batch: int, columns: int) -> _Graph:
        """Static buffers for one shape, filled as padding."""

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        entry = _Graph(
            longs(batch), longs(batch), longs(batch), longs(batch, columns), longs(batch)
        )
        entry.slots.fill_(self.kv_cache.scratch_slot)
        entry.lengths.fill_(1)
        return entry

    def _forward(self, entry: _Graph) -> torch.Tensor:
        """The decoder over ``entry``'s buffers (the masked, padded decode attention)."""
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=[entry.slots],
            num_decode=entry.input_ids.shape[0],
            decode_blocks=[entry.tables],
            decode_lengths=entry.lengths,
            prefills=[],
            workspace=entry.workspace,
            dtype=self.runner.dtype,
        )
        return self.runner.forward(entry.input_ids[None], entry.positions[None], metadata)

    def _capture(self, entry: _Graph, key: tuple[int, int]) -> None:
        """Record ``entry``'s graph (its buffers already hold this step's inputs: the
        warm-up run computes nothing the replay does not redo). On failure, log and stop
        capturing: this step and the later ones run eagerly."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(entry)  # allocates the workspace; loads the kernels
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.hidden = self._forward(entry)
        except Exception as exc:  # a capture error must not end the engine
            logger.warning(
                "CUDA graph capture failed for batch %d x %d blocks (%s: %s); decode "
                "steps run eagerly from now on",
                *key,
                type(exc).__name__,
                exc,
            )
            self.capture = False
            self._graphs.clear()
            return
        entry.graph = graph
        self.num_captured += 1
        logger.info("captured a CUDA graph for decode batch %d x %d blocks", *key)
