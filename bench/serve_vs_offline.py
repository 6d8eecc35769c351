"""One run, same workload: the 2-process server, the 3-process server, the offline engine.

    python bench/serve_vs_offline.py --num-prompts 64 --input-len 250 --output-len 128
    python bench/serve_vs_offline.py ... --profile bench/results/profiles

For each ``--detokenizer-mode`` (inline = 2 processes, process = 3 processes) it starts
``trio-llm serve`` on a free port, runs bench/serve.py's streaming client against it with
all requests sent at once, and stops it; then it runs bench/throughput.py's offline engine
on the same prompts. Prints req/s and output tok/s of each, the ratios to the offline
engine, and the CPU seconds each process used during the run (from /proc, free of
overhead). ``--profile DIR`` adds a second pass per mode with py-spy attached to every
process and prints the functions each one spends its samples in (that pass is slowed by
the sampling; its throughput is not reported).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import roofline
import serve
import throughput
import trio
from common import print_table, write_json
from process_cpu import CpuMeter, Profiler, top_frames

from tests.support.server_process import ServerProcess

MODES = {"inline": "2 processes", "process": "3 processes"}


def server_args(args: argparse.Namespace, mode: str) -> list[str]:
    return [
        "--model", args.model,
        "--dtype", args.dtype,
        "--device", args.device,
        *(["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory else []),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--detokenizer-mode", mode,
        *(["--enforce-eager"] if args.enforce_eager else []),
        "--stream-interval", str(args.stream_interval),
    ]  # fmt: skip


def run_server(args: argparse.Namespace, mode: str, profile_dir: Path | None = None) -> dict:
    """One client run against a fresh server; adds ``cpu_s`` (per process) to the result."""
    log = Path(tempfile.mkdtemp(prefix="trio-llm-bench-")) / "server.log"
    with ServerProcess(server_args(args, mode), log_path=log) as server:
        args.base_url = server.url
        args.label = f"trio_llm server, {MODES[mode]} ({args.dtype}, {args.device})"
        prompts = serve.load_prompts(args)
        meter = CpuMeter(server.pid)
        profiler = Profiler(server.pid, profile_dir) if profile_dir else None
        if profiler:
            profiler.start()
        meter.start()
        client_cpu = time.process_time()
        result = trio.run(serve.run, args, prompts)
        result["cpu_s"] = meter.stop()
        result["cpu_s"]["bench client"] = time.process_time() - client_cpu
        if profiler:
            result["profiles"] = {k: str(v) for k, v in profiler.stop().items()}
    return result


def print_profiles(mode: str, files: dict[str, str]) -> None:
    print(f"\npy-spy, {MODES[mode]}: leaf functions by share of each process's samples")
    for name, path in files.items():
        frames = top_frames(Path(path), count=6)
        print(f"  {name}:")
        for frame, share in frames:
            print(f"    {share:6.1%}  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput.add_workload_args(parser)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy output folder")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the servers' --stream-interval"
    )
    parser.add_argument("--json", default="bench/results/serve_vs_offline.json")
    args = parser.parse_args()
    args.max_concurrency = 0
    args.request_rate = float("inf")
    args.prompt_format = "tokens"
    args.tokenizer_dir = args.model if Path(args.model).is_dir() else None

    online = {mode: run_server(args, mode) for mode in args.modes}
    offline = throughput.run(args)
    profiles = {}
    if args.profile:
        for mode in args.modes:
            profiles[mode] = run_server(args, mode, args.profile / mode)["profiles"]
    gflops = roofline.gemm_gflops(roofline.DTYPES[args.dtype], args.device)
    prompt_tokens = offline["prompt_tokens"]
    ceiling = roofline.tokens_per_second(gflops, prompt_tokens, offline["output_tokens"])
    output_share = offline["output_tokens"] / (prompt_tokens + offline["output_tokens"])

    print(
        f"\nworkload: {args.num_prompts} requests x {args.input_len} prompt tokens -> "
        f"{args.output_len} output tokens, all sent at once; {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    for result in online.values():
        row = {**result, "requests": result["completed"]}
        row["vs_offline"] = result["output_tok_per_s"] / offline["output_tok_per_s"]
        rows.append(row)
    rows.append({**offline, "vs_offline": 1.0})
    print_table(rows, [*throughput.COLUMNS, "vs_offline"])
    if len(online) == 2:
        ratio = online["process"]["output_tok_per_s"] / online["inline"]["output_tok_per_s"]
        print(f"3-process / 2-process output throughput: {ratio:.3f}")
    print("\nCPU seconds used by each process during the client run:")
    for mode, result in online.items():
        used = ", ".join(f"{name} {sec:.1f} s" for name, sec in result["cpu_s"].items())
        print(f"  {MODES[mode]}: {used} (elapsed {result['elapsed_s']:.1f} s)")
    print(
        f"\nroofline ({args.dtype} GEMM on {args.device}, {gflops:.0f} GFLOP/s measured now): "
        f"{ceiling:.0f} total tok/s = "
        f"{ceiling * output_share:.0f} output tok/s; offline reaches "
        f"{offline['total_tok_per_s'] / ceiling:.0%} of it"
    )
    for mode, result in online.items():
        ttft, itl = result["ttft_s"], result["itl_s"]
        print(
            f"{MODES[mode]}: TTFT median {ttft['median']:.2f} s, p99 {ttft['p99']:.2f} s; "
            f"ITL median {itl['median'] * 1000:.0f} ms, p99 {itl['p99'] * 1000:.0f} ms"
        )
        if result["errors"]:
            print(f"  errors: {result['errors']} (first: {result['first_error']})")
    for mode, files in profiles.items():
        print_profiles(mode, files)
    write_json(
        args.json,
        {
            "servers": online,
            "offline": offline,
            "gemm_gflops": gflops,
            "roofline_total_tok_per_s": ceiling,
            "args": {k: str(v) for k, v in vars(args).items()},
        },
    )


if __name__ == "__main__":
    main()
