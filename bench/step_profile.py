"""Where a batched engine step's time goes: products, attention, other operators, Python.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/step_profile.py [--num-prompts 64]

Drives `EngineCore` in process (``--dtype auto``, the default model) with ``--num-prompts``
requests of ``--input-len`` sonnet tokens, all at once, as the offline target does. It
times every step (wall clock, no profiler), splitting the run into the prefill phase
(steps that schedule prompt tokens) and the decode phase, then profiles
``--profile-steps`` decode steps with `torch.profiler` and sorts the operators' own CPU
time into buckets:

- ``products``: the projections (``aten::mm``, ``aten::addmm``, ``aten::linear``'s kernels,
  the GGUF and int4/int8 kernels);
- ``attention``: the paged decode kernel, SDPA and flash attention;
- ``other operators``: everything else torch ran (norms, rotary, KV writes, sampling, ...);
- ``Python and dispatch``: the profiled step's wall time less all operators' own time;

and lists the ``--top`` operators by own time, with their calls per step.

The profiler's own overhead inflates the last two, so the buckets are given as shares of
the profiled steps and the step time is the unprofiled one. Finally the GEMM rate at the
decode batch's shapes (M = the batch) against the M = 1,024 rate the roofline uses
(`roofline.gemm_gflops` with ``rows``), which bounds what a decode step's products can reach.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import roofline
import torch
from common import sonnet_prompts

from trio_llm.config import DEFAULT_MODEL, default_cache_dir, engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int", "trio_llm::gguf")
ATTENTION = ("trio_llm::paged_attention", "aten::_scaled_dot_product", "aten::_flash_attention")


def bucket(name: str) -> str:
    """The bucket of one profiler event name."""
    if name.startswith(PRODUCTS):
        return "products"
    if name.startswith(ATTENTION):
        return "attention"
    return "other operators"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--top", type=int, default=12, help="operators listed by own time")
    args = parser.parse_args()

    config = engine_config(
        DEFAULT_MODEL, dtype="auto", max_num_seqs=args.num_prompts, quantization=args.quantization
    )
    core = EngineCore.from_config(config)
    tokenizer = Tokenizer.load(resolve_model_dir(DEFAULT_MODEL, default_cache_dir()))
    prompts = sonnet_prompts(tokenizer, args.num_prompts, args.input_len, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", prompt, params))

    phases: dict[str, list[float]] = collections.defaultdict(list)
    profiled: list[float] = []
    totals: collections.Counter[str] = collections.Counter()
    per_op: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    decode_steps = 0
    profile_from = 10  # decode steps in, so that every request decodes
    while core.has_work():
        prefilling = bool(core.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        )
        if not prefilling and profile_from <= decode_steps < profile_from + args.profile_steps:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                core.step()
                wall = time.perf_counter() - start
            profiled.append(wall)
            own = 0.0
            for event in prof.key_averages():
                seconds = event.self_cpu_time_total / 1e6
                totals[bucket(event.key)] += seconds
                per_op[event.key] += seconds
                calls[event.key] += event.count
                own += seconds
            totals["Python and dispatch"] += max(0.0, wall - own)
        else:
            start = time.perf_counter()
            core.step()
            phases["prefill" if prefilling else "decode"].append(time.perf_counter() - start)
        if not prefilling:
            decode_steps += 1
    core.close()

    dtype = core.kv_cache.keys[0].dtype
    print(
        f"{args.num_prompts} x ({args.input_len} -> {args.output_len}) tokens, {dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    for phase, times in phases.items():
        print(
            f"  {phase}: {len(times)} steps, {sum(times):.1f} s, median step "
            f"{statistics.median(times) * 1000:.1f} ms"
        )
    whole = sum(profiled)
    print(f"  profiled decode steps: {len(profiled)}, {whole / len(profiled) * 1000:.1f} ms each")
    for name, seconds in totals.most_common():
        print(f"    {name:<22} {seconds / whole:6.1%}")
    print(f"  the {args.top} operators with the most own time (per profiled step):")
    for name, seconds in per_op.most_common(args.top):
        print(
            f"    {name:<40} {seconds / len(profiled) * 1000:6.2f} ms "
            f"{calls[name] / len(profiled):6.0f} calls"
        )
    decode = statistics.median(phases["decode"])
    flops = 2 * (roofline.NON_EMBEDDING_PARAMS + roofline.LM_HEAD_PARAMS) * args.num_prompts
    at_m = roofline.gemm_gflops(dtype, rows=args.num_prompts)
    at_1024 = roofline.gemm_gflops(dtype)
    print(
        f"  GEMM at M={args.num_prompts}: {at_m:.0f} GFLOP/s, at M=1024: {at_1024:.0f} "
        f"GFLOP/s; a decode step's products ({flops / 1e9:.1f} GFLOP) take at least "
        f"{flops / at_m / 1e6:.1f} ms at M={args.num_prompts}, the step takes "
        f"{decode * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
