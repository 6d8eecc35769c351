"""The engine-speed targets, each printed as ``target: measured vs goal`` from one run.

    make bench-peers                                   # once: llama-cpp-python
    HF_HUB_OFFLINE=1 .venv/bin/python bench/turn.py [--parts c1 batched clients contention]

Parts (same machine, same run; figures are ratios against llama-cpp-python's OpenAI
server on the same GGUF with 2 threads, or against the GEMM roofline measured here):

- ``c1``: one client. trio_llm servers (``--modes``: ``auto`` = ``--dtype auto``, ``int8``,
  ``int4`` = ``--quantization``) and llama-cpp are all started, then ``--rounds``
  interleaved rounds send each the same ``--c1-requests`` chat requests one after another
  (``--c1-input-len`` sonnet tokens, ``--c1-output-len`` output tokens, greedy). Per round
  and system the ITL median; the target compares the median of the per-round ratios.
- ``batched``: the offline engine (``LLM.generate``, ``--dtype auto``) on the seed-like
  workload (``--num-prompts`` x ``--input-len`` -> ``--output-len``, all at once) against
  the roofline: the GEMM rate of that dtype at the model's shapes, turned into tok/s.
- ``clients``: 32 clients (output tok/s) and 8 clients (TTFT median), trio_llm
  (``--clients-mode``) against llama-cpp, ``--sweep-output-len`` tokens each.
- ``contention``: `bench/contention.py`'s runs (alone, beside a one-core hog, two engines).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import compare
import contention
import gpu_targets
import roofline
import trio
from common import sonnet_prompts, write_json
from compare import System, Workload, chat_prompt_tokens, run_http, text_prompts

from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.dtype_choice import resolve_dtype
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.model_files.named_models import default_gguf_path
from trio_llm.text.tokenizer import Tokenizer

MODES = {
    "auto": ["--dtype", "auto"],
    "int8": ["--dtype", "auto", "--quantization", "int8"],
    "int4": ["--dtype", "auto", "--quantization", "int4"],
}


def trio_system(mode: str) -> System:
    return System(
        f"trio-{mode}", "server", trio_args=[*MODES[mode], "--detokenizer-mode", "inline"]
    )


def llama_cpp() -> System:
    systems = compare.build_systems(
        argparse.Namespace(dtypes=[], max_num_seqs=1, max_num_batched_tokens=1),
        resolve_model_dir(DEFAULT_MODEL, default_cache_dir()),
        default_gguf_path(),
    )
    return systems["llama-cpp"]


def part_c1(args: argparse.Namespace, tokenizer: Tokenizer, model_dir: Path, logs: Path) -> dict:
    prompts = text_prompts(tokenizer, args.c1_requests, args.c1_input_len, args.seed + 11)
    workload = Workload(
        "c1", prompts, args.c1_output_len, 1, chat_prompt_tokens(model_dir, prompts)
    )
    systems = [trio_system(mode) for mode in args.modes] + [llama_cpp()]
    itl: dict[str, list[float]] = {s.name: [] for s in systems}
    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    with contextlib.ExitStack() as stack:
        urls = {s.name: stack.enter_context(s.serve(logs)) for s in systems}
        for system in systems:  # warm-up: first requests pay one-off costs
            trio.run(
                run_http,
                urls[system.name],
                system,
                Workload("warm", prompts[:1], 8, 1, workload.prompt_tokens[:1]),
            )
        for round_ in range(args.rounds):
            for system in systems:
                row = trio.run(run_http, urls[system.name], system, workload)
                itl[system.name].append(row["itl_s"]["median"])
                rates[system.name].append(row["output_tok_per_s"])
                print(
                    f"  round {round_ + 1} {system.name}: ITL median "
                    f"{row['itl_s']['median'] * 1000:.1f} ms, {row['output_tok_per_s']:.1f} tok/s",
                    flush=True,
                )
    ratios = {
        name: statistics.median(a / b for a, b in zip(itl[name], itl["llama-cpp"], strict=True))
        for name in itl
        if name != "llama-cpp"
    }
    return {"itl_s": itl, "output_tok_per_s": rates, "itl_ratio_vs_llama_cpp": ratios}


def part_batched(args: argparse.Namespace, tokenizer: Tokenizer) -> dict:
    from trio_llm import LLM
    from trio_llm.messages import SamplingParams

    prompts = sonnet_prompts(tokenizer, args.num_prompts, args.input_len, seed=args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with LLM(DEFAULT_MODEL, dtype="auto", max_num_seqs=args.num_prompts) as llm:
        dtype = llm.info.dtype
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    output = sum(len(r.token_ids) for r in results)
    prompt = sum(len(p) for p in prompts)
    gflops = roofline.gemm_gflops(roofline.DTYPES[dtype])
    ceiling = roofline.tokens_per_second(gflops, prompt, output)
    total = (prompt + output) / elapsed
    return {
        "dtype": dtype,
        "elapsed_s": elapsed,
        "total_tok_per_s": total,
        "output_tok_per_s": output / elapsed,
        "gemm_gflops": gflops,
        "roofline_total_tok_per_s": ceiling,
        "of_roofline": total / ceiling,
    }


def part_clients(
    args: argparse.Namespace, tokenizer: Tokenizer, model_dir: Path, logs: Path
) -> dict:
    result: dict[str, Any] = {}
    for clients in (32, 8):
        prompts = text_prompts(tokenizer, clients, args.input_len, args.seed + 100 + clients)
        workload = Workload(
            "clients",
            prompts,
            args.sweep_output_len,
            clients,
            chat_prompt_tokens(model_dir, prompts),
        )
        for system in (trio_system(args.clients_mode), llama_cpp()):
            with system.serve(logs) as url:
                row = trio.run(run_http, url, system, workload)
            result[f"{system.name}@{clients}"] = {
                "output_tok_per_s": row["output_tok_per_s"],
                "ttft_median_s": row["ttft_s"]["median"],
                "completed": row["completed"],
            }
            print(
                f"  {clients} clients {system.name}: {row['output_tok_per_s']:.1f} tok/s, "
                f"TTFT median {row['ttft_s']['median']:.2f} s",
                flush=True,
            )
    return result


def target_lines(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = []
    c1 = report.get("c1")
    if c1:
        peer = statistics.median(c1["itl_s"]["llama-cpp"]) * 1000
        for name, ratio in c1["itl_ratio_vs_llama_cpp"].items():
            ours = statistics.median(c1["itl_s"][name]) * 1000
            lines.append(
                f"target 1 (c=1 ITL, {name} / llama-cpp): {ours:.1f} / {peer:.1f} ms, median "
                f"ratio over {args.rounds} rounds {ratio:.2f} vs goal <= 1.00"
            )
    batched = report.get("batched")
    if batched:
        lines.append(
            f"target 2 (offline, {args.num_prompts} concurrent, {batched['dtype']}): "
            f"{batched['total_tok_per_s']:.1f} total tok/s = {batched['of_roofline']:.0%} of "
            f"the {batched['dtype']} roofline ({batched['gemm_gflops']:.0f} GFLOP/s) vs goal "
            ">= 70 %"
        )
    clients = report.get("clients")
    if clients:
        ours, theirs = f"trio-{args.clients_mode}", "llama-cpp"
        a, b = clients[f"{ours}@32"], clients[f"{theirs}@32"]
        lines.append(
            f"target 3a (32 clients, output tok/s {ours} / llama-cpp): "
            f"{a['output_tok_per_s']:.1f} / {b['output_tok_per_s']:.1f} = "
            f"{a['output_tok_per_s'] / b['output_tok_per_s']:.1f}x vs goal >= 5x"
        )
        a, b = clients[f"{ours}@8"], clients[f"{theirs}@8"]
        lines.append(
            f"target 3b (8 clients, TTFT median {ours} / llama-cpp): "
            f"{a['ttft_median_s']:.2f} / {b['ttft_median_s']:.2f} s vs goal <= 1x "
            f"(ratio {a['ttft_median_s'] / b['ttft_median_s']:.2f})"
        )
    for row in report.get("contention", {}).get("rows", []):
        lines.append(
            f"target 5 ({row['setting']}): beside a one-core hog {row['hog slowdown']:.2f}x "
            f"slower, two engines {row['pair slowdown']:.2f}x slower each, vs goal <= 2.2x"
        )
    gpu = args.gpu_results
    if gpu is not None and (gpu / "offline.json").exists():
        lines += gpu_targets.target_lines(gpu)
    else:
        lines.append(
            "target 4 (GPU): not measured in this run; bench/device_run.sh on a lent GPU, "
            "then --gpu-results OUT_DIR prints its lines here"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["c1", "batched", "clients", "contention"])
    parser.add_argument(
        "--modes", nargs="+", choices=sorted(MODES), default=["auto", "int8", "int4"]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--gpu-results", type=Path, default=None, help="bench/device_run.sh's $OUT folder"
    )
    parser.add_argument("--c1-requests", type=int, default=3)
    parser.add_argument("--c1-input-len", type=int, default=128)
    parser.add_argument("--c1-output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sweep-output-len", type=int, default=64)
    parser.add_argument("--clients-mode", choices=sorted(MODES), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/turn.json")
    args = parser.parse_args()
    if not compare.PEERS.is_dir() and {"c1", "clients"} & set(args.parts):
        sys.exit("llama-cpp-python is missing: run `make bench-peers` first")
    logs = Path(tempfile.mkdtemp(prefix="trio-llm-turn-"))
    model_dir = resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    tokenizer = Tokenizer.load(model_dir)
    report: dict[str, Any] = {"machine": compare.machine(), "auto": resolve_dtype("auto", "cpu")}
    print(f"machine: {report['machine']}; logs in {logs}", flush=True)
    if "c1" in args.parts:
        print("\n== c=1", flush=True)
        report["c1"] = part_c1(args, tokenizer, model_dir, logs)
    if "batched" in args.parts:
        print("\n== batched (offline)", flush=True)
        report["batched"] = part_batched(args, tokenizer)
    if "clients" in args.parts:
        print("\n== clients", flush=True)
        report["clients"] = part_clients(args, tokenizer, model_dir, logs)
    if "contention" in args.parts:
        print("\n== contention", flush=True)
        workload = argparse.Namespace(
            num_prompts=32, input_len=128, output_len=32, dtype="auto", quantization=None
        )
        rows = []
        for threads in (None, "auto"):
            workload.num_threads = threads
            label = f"--num-threads {threads or 'default'}"
            rows.append(contention.measure(workload, "default", label))
        report["contention"] = {"rows": rows}
    lines = target_lines(report, args)
    report["targets"] = lines
    print("\ntargets:")
    for line in lines:
        print(line)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
