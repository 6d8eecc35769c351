"""Decode attention: the native CPU kernel (``--attention-backend CPU_ATTN``) against the
pure-torch reference path (``TORCH_SDPA``), interleaved in one run.

Offline, in this process, on SmolLM2-135M (the default model, its dtype resolved as the
server does)::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_attention.py
    HF_HUB_OFFLINE=1 .venv/bin/python bench/native_attention.py --contexts 256 7000 --rounds 5

For each case (one request at 256 / 2,048 / 4,096 / 7,000 tokens of context, then a
batch of 32 requests at 256 and 1,024) it fills the KV cache with random keys and values
(attention's cost does not depend on them), then times, alternating the two backends in
every round:

- one layer's attention call (`paged_attention`, the new token's KV write included);
- the whole decode step's forward pass (`ModelRunner.forward`: all 30 layers, the
  projections included; the sampler and the output projection not), the part of the ITL
  that changes with the context.

``--prefill-chunk N`` (default 128, the CPU's long-prefill chunk; 0 skips it) also times,
per layer, the reference's chunked prefill with context at each context length: the copy
of the context's keys and values (``index_select``) plus its mask, against the SDPA call.

Each figure is the median over ``--rounds`` rounds of the median of ``--steps`` calls.
Timings taken while other processes run are noisy; the ratios of one run are the figure
to read. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from trio_llm.config import DEFAULT_MODEL, EngineConfig, ModelConfig, SchedulerConfig, engine_config
from trio_llm.engine import attention
from trio_llm.engine.attention import ATTENTION_NAME, paged_attention
from trio_llm.engine.attention_metadata import PagedAttentionMetadata, chunk_mask
from trio_llm.engine.block_manager import cdiv
from trio_llm.engine.core import EngineCore
from trio_llm.model_files.loader import load_model, resolve_model_dir

BACKENDS = ("TORCH_SDPA", "CPU_ATTN")


def _median_ms(call: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _metadata(core: EngineCore, lengths: list[int], native: bool) -> PagedAttentionMetadata:
    """A decode step of ``len(lengths)`` requests whose contexts fill consecutive blocks."""
    bs = core.kv_cache.block_size
    columns = max(cdiv(length, bs) for length in lengths)
    tables = torch.zeros(len(lengths), columns, dtype=torch.long)
    next_block = 1
    for n, length in enumerate(lengths):
        count = cdiv(length, bs)
        tables[n, :count] = torch.arange(next_block, next_block + count)
        next_block += count
    lens = torch.tensor(lengths)
    pos = lens - 1
    slots = tables[torch.arange(len(lengths)), pos // bs] * bs + pos % bs
    return PagedAttentionMetadata(
        kv_cache=core.kv_cache,
        slot_mapping=[slots] * len(core.kv_cache.groups.layers),
        num_decode=len(lengths),
        decode_blocks=[tables] * len(core.kv_cache.groups.layers),
        decode_lengths=lens,
        prefills=[],
        workspace={},
        dtype=core.runner.dtype,
        decode_context_lens=list(lengths),
        native_attention=native,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 4096, 7000])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None, help="default: every core")
    parser.add_argument("--prefill-chunk", type=int, default=128)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    cases = [[length] for length in args.contexts]
    cases += [[length] * args.batch for length in args.batch_contexts]
    block_size = 16
    needed = max(sum(cdiv(n, block_size) for n in case) for case in cases) + 2
    base = engine_config(args.model, max_model_len=8192, num_kv_blocks=needed)
    model_dir = resolve_model_dir(args.model, base.cache_dir())
    model = load_model(model_dir, "auto", ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=8192, attention_backend="CPU_ATTN"),
        cache=base.cache,
        scheduler=SchedulerConfig(),
    )
    core = EngineCore(model, config, str(model_dir))
    gen = torch.Generator().manual_seed(0)
    for tensor in {id(t): t for t in (*core.kv_cache.keys, *core.kv_cache.values)}.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    dtype = core.runner.dtype
    spec = core.kv_cache.layers[0]
    heads = model.config.num_attention_heads
    print(
        f"{args.model}: {dtype}, {torch.get_num_threads()} threads, {len(core.kv_cache.layers)} "
        f"layers, {heads} heads over {spec.num_kv_heads} KV heads of {spec.head_dim}; "
        f"median of {args.rounds} interleaved rounds x {args.steps} calls"
    )
    print(
        "| requests x context | layer attention TORCH_SDPA | CPU_ATTN | ratio "
        "| decode forward TORCH_SDPA | CPU_ATTN | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    layer0 = SimpleNamespace(layer_idx=0)
    for case in cases:
        n = len(case)
        results: dict[tuple[str, str], list[float]] = {}
        q = torch.randn(1, heads, n, spec.head_dim, generator=gen).to(dtype)
        kv = torch.randn(1, spec.num_kv_heads, n, spec.head_dim, generator=gen).to(dtype)
        ids = torch.randint(100, 40000, (1, n), generator=gen)
        positions = torch.tensor([case]) - 1
        for _ in range(args.rounds):
            for backend in BACKENDS:
                meta = _metadata(core, case, native=backend == "CPU_ATTN")
                attend = functools.partial(paged_attention, layer0, q, kv, kv, None, paged=meta)
                forward = functools.partial(core.runner.forward, ids, positions, meta)
                with torch.inference_mode():
                    attend()  # warm the workspace
                    results.setdefault((backend, "attn"), []).append(_median_ms(attend, args.steps))
                    results.setdefault((backend, "step"), []).append(
                        _median_ms(forward, args.steps)
                    )
        med = {key: statistics.median(values) for key, values in results.items()}
        a_ref, a_nat = med["TORCH_SDPA", "attn"], med["CPU_ATTN", "attn"]
        s_ref, s_nat = med["TORCH_SDPA", "step"], med["CPU_ATTN", "step"]
        print(
            f"| {n} x {case[0]:,} | {a_ref:.3f} ms | {a_nat:.3f} ms | {a_ref / a_nat:.2f}x "
            f"| {s_ref:.1f} ms | {s_nat:.1f} ms | {s_ref / s_nat:.2f}x |",
            flush=True,
        )
    if args.prefill_chunk:
        _prefill(core, args.contexts, args.prefill_chunk, heads, args.rounds, gen)


def _prefill(
    core: EngineCore,
    contexts: list[int],
    chunk: int,
    heads: int,
    rounds: int,
    gen: torch.Generator,
) -> None:
    """The reference's chunked prefill with context, per layer: copy + mask vs SDPA."""
    k_cache, v_cache = core.kv_cache.keys[0], core.kv_cache.values[0]
    spec = core.kv_cache.layers[0]
    print(f"\n| context (chunk of {chunk}) | copy + mask | SDPA | copy share |")
    print("|---|---|---|---|")
    for context in contexts:
        slots = torch.arange(context) + core.kv_cache.block_size
        q = torch.randn(1, heads, chunk, spec.head_dim, generator=gen).to(k_cache.dtype)
        copies, attends = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            k = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            v = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            mask = chunk_mask(chunk, context, 0, None, q.device)
            middle = time.perf_counter()
            attention.attend(q, k, v, mask, None, None, enable_gqa=True)
            copies.append(middle - start)
            attends.append(time.perf_counter() - middle)
        copy, attend = statistics.median(copies), statistics.median(attends)
        print(
            f"| {context:,} | {1e3 * copy:.2f} ms | {1e3 * attend:.2f} ms "
            f"| {copy / (copy + attend):.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
