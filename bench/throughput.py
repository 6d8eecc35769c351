"""Offline throughput of the engine core: N requests at once, no server, no IPC.

    python bench/throughput.py --num-prompts 64 --input-len 250 --output-len 128

Prints req/s, output tok/s and total (prompt + output) tok/s. Every request generates
exactly ``--output-len`` tokens (EOS ignored).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import print_table, sonnet_prompts, write_json

from trio_llm.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from trio_llm.engine.core import EngineCore
from trio_llm.frontend.tokenizer import Tokenizer
from trio_llm.messages import AddRequest, SamplingParams

COLUMNS = ["system", "requests", "elapsed_s", "req_per_s", "output_tok_per_s", "total_tok_per_s"]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )


def run(args: argparse.Namespace) -> dict:
    core = EngineCore.from_config(engine_config(args))
    core.warm_up()
    tokenizer = Tokenizer.load(core.info.model_dir)
    prompts = sonnet_prompts(tokenizer, args.num_prompts, args.input_len, seed=args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"bench-{i}", prompt, params))
    output_tokens = 0
    steps = 0
    while core.has_unfinished_requests():
        result = core.step()
        steps += 1
        output_tokens += sum(len(o.new_token_ids) for o in result.outputs)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "system": f"trio_llm offline ({core.info.dtype})",
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
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    print_table(
        [result],
        ["system", "requests", "elapsed_s", "req_per_s", "output_tok_per_s", "total_tok_per_s"],
    )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
