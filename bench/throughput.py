"""Offline throughput through `trio_llm.LLM`: N requests at once, no HTTP server.

    python bench/throughput.py --num-prompts 64 --input-len 250 --output-len 128

Prints req/s, output tok/s and total (prompt + output) tok/s. Every request generates
exactly ``--output-len`` tokens (EOS ignored). The prompts are token ids, handed to
`LLM.generate` in one batch: the engine core runs in its child process as it does under
the server, so the figures include the IPC hop and the detokenization in this process,
but not the model load (the clock starts once `LLM` is ready).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import print_table, sonnet_prompts, write_json

from trio_llm import LLM
from trio_llm.cli.types import parse_bytes
from trio_llm.config import (
    DEFAULT_MODEL,
    DEVICES,
    MODEL_IMPLS,
    QUANTIZATION_METHODS,
    SchedulerConfig,
)
from trio_llm.messages import SamplingParams

COLUMNS = ["system", "requests", "elapsed_s", "req_per_s", "output_tok_per_s", "total_tok_per_s"]


def run(args: argparse.Namespace) -> dict:
    with LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        model_impl=args.model_impl,
        enforce_eager=args.enforce_eager,
        num_threads=None if args.num_threads in (None, "auto") else int(args.num_threads),
        adaptive_threads=True if args.num_threads == "auto" else None,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    ) as llm:
        prompts = sonnet_prompts(llm.tokenizer, args.num_prompts, args.input_len, seed=args.seed)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        steps_before = llm.stats.num_steps
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        steps = llm.stats.num_steps - steps_before
        dtype = llm.info.dtype
    output_tokens = sum(len(result.token_ids) for result in results)
    prompt_tokens = sum(len(p) for p in prompts)
    quantized = f", {args.quantization}" if args.quantization else ""
    if args.enforce_eager and args.device == "cuda":
        quantized += ", eager"
    return {
        "system": f"trio_llm offline ({dtype}{quantized}, {args.device})",
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "steps": steps,
        "req_per_s": len(prompts) / elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="on a GPU: no CUDA graphs for decode steps"
    )
    parser.add_argument(
        "--num-threads",
        default=None,
        help="N, or auto (the default: all cores, one fewer per core others take)",
    )
    parser.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None, help="e.g. 8GiB (default 2 GiB)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="tokens (0: off; default: the engine's, 128 on the CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    print_table([result], COLUMNS)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
