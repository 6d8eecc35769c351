"""Quality and batch-1 speed of each ``--quantization`` mode against float32.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/quantization.py [--windows 8] [--prompts 8]

Per mode (float32 through transformers' modules and through the engine's own forward
pass, bfloat16, int8, int4), an in-process `EngineCore` on the default model:

- perplexity on bench/data/sonnet.txt: ``--windows`` windows of ``--window`` tokens, each
  a request with ``prompt_logprobs=0`` (the engine's own logprobs of every prompt token);
- greedy agreement with float32: ``--prompts`` sonnet prompts of 64 tokens, 64 greedy
  output tokens each; the share of output positions equal to float32's, and how many
  tokens match before the first difference (median);
- batch-1 decode step: the median step time of one request decoding (its 64 tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from common import print_table, sonnet_prompts, write_json

from trio_llm.config import DEFAULT_MODEL, engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.text.tokenizer import Tokenizer

MODES = {
    "fp32 (transformers)": {"model_impl": "transformers"},
    "fp32": {},
    # What --dtype auto picks on a CPU with native bf16 arithmetic (emulated, slow, elsewhere).
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def _drain(core: EngineCore) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens, logprobs = out.setdefault(output.request_id, ([], []))
            tokens += output.new_token_ids
            logprobs += [e.logprob for e in output.prompt_logprobs or []]
    return out


def measure(mode: dict, windows: list[list[int]], prompts: list[list[int]]) -> dict:
    core = EngineCore.from_config(engine_config(DEFAULT_MODEL, **{"dtype": "float32", **mode}))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        for i, window in enumerate(windows):
            core.add_request(AddRequest(f"w{i}", window, params))
        logprobs = [x for _, lp in _drain(core).values() for x in lp]
        greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            core.add_request(AddRequest(f"p{i}", prompt, greedy))
        outputs = _drain(core)
        tokens = [outputs[f"p{i}"][0] for i in range(len(prompts))]
        core.add_request(AddRequest("one", prompts[0], greedy))
        times = []
        while core.has_unfinished_requests():
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
    finally:
        core.close()
    return {
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "tokens": tokens,
        "step_ms": statistics.median(times[1:]) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=None, help="default: all")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from trio_llm.config import default_cache_dir
    from trio_llm.model_files.loader import resolve_model_dir

    tokenizer = Tokenizer.load(resolve_model_dir(DEFAULT_MODEL, default_cache_dir()))
    windows = sonnet_prompts(tokenizer, args.windows, args.window, seed=1)
    prompts = sonnet_prompts(tokenizer, args.prompts, 64, seed=2)
    modes = {k: v for k, v in MODES.items() if not args.modes or k in args.modes}
    results = {name: measure(mode, windows, prompts) for name, mode in modes.items()}
    reference = results["fp32"]["tokens"]
    rows = []
    for name, result in results.items():
        equal = total = 0
        prefixes = []
        for ours, theirs in zip(result["tokens"], reference, strict=True):
            equal += sum(a == b for a, b in zip(ours, theirs, strict=True))
            total += len(theirs)
            same = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                len(theirs),
            )
            prefixes.append(same)
        rows.append(
            {
                "mode": name,
                "perplexity": result["perplexity"],
                "greedy positions = fp32": f"{equal / total:.1%}",
                "tokens before first difference (median)": statistics.median(prefixes),
                "batch-1 step ms": result["step_ms"],
            }
        )
    print_table(rows, list(rows[0]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
