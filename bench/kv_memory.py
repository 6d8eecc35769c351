"""KV cache memory of one long request, with sliding-window layers freeing the blocks
behind their window (the default) and with every block kept
(``--disable-hybrid-kv-cache-manager``).

    python bench/kv_memory.py --model gemma-3-270m --context 8192

Runs an `EngineCore` in this process (no server): one request of ``--context`` prompt
tokens plus ``--output-len`` generated ones, and reports the most KV cache bytes it held at
once (after any step), the bytes per token of context, and the longest context one
request can have within the default ``--kv-cache-memory`` (capped by the model's
``max_position_embeddings``).
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from common import print_table

from trio_llm.config import DEFAULT_MODEL, engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.engine.kv_cache import KVCache, blocks_for_one_request
from trio_llm.messages import AddRequest, SamplingParams


def longest_context(core: EngineCore, limit: int) -> int:
    """The longest context (tokens, at most ``limit``) one request can hold in ``core``."""
    low, high = 0, limit
    block_size = core.info.block_size
    budget = core.config.scheduler.max_num_batched_tokens
    while low < high:
        mid = (low + high + 1) // 2
        needed = blocks_for_one_request(core.kv_groups, mid, block_size, budget)
        low, high = (mid, high) if needed <= core.info.num_kv_blocks else (low, mid - 1)
    return low


def run(model: str, dtype: str, context: int, output_len: int, hybrid: bool) -> dict:
    """One request through a fresh core; its peak KV bytes and the cache's capacity."""
    config = engine_config(model, dtype=dtype, seed=0, disable_hybrid_kv_cache_manager=not hybrid)
    core = EngineCore.from_config(config)
    block_bytes = KVCache.bytes_per_block(
        core.layers, core.kv_groups, core.info.block_size, getattr(torch, core.info.dtype)
    )
    prompt = [(i * 7919) % 1000 + 100 for i in range(context)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    core.add_request(AddRequest("r", prompt, params))
    peak = 0
    while core.has_unfinished_requests():
        stats = core.step().stats
        peak = max(peak, core.info.num_kv_blocks - stats.num_free_blocks)
    limit = core.info.max_model_len
    result = {
        "kv_cache": "window groups free blocks" if hybrid else "every block kept",
        "groups": len(core.kv_groups.windows),
        "bytes_per_block": block_bytes,
        "peak_blocks": peak,
        "peak_kv_MB": round(peak * block_bytes / 1e6, 1),
        "kv_bytes_per_token": round(peak * block_bytes / (context + output_len)),
        "longest_context": longest_context(core, limit),
    }
    del core
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=4)
    args = parser.parse_args()
    rows = [run(args.model, args.dtype, args.context, args.output_len, h) for h in (True, False)]
    print(f"{args.model}, one request of {args.context} + {args.output_len} tokens:")
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
