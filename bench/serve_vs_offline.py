"""One run, same workload: the HTTP server (2 processes) vs the offline engine core.

    python bench/serve_vs_offline.py --num-prompts 64 --input-len 250 --output-len 128

Starts ``trio-llm serve`` on a free port, runs bench/serve.py's client against it with all
requests sent at once, stops it, then runs bench/throughput.py's offline loop in this
process on the same prompts. Prints both and the server/offline ratio of output tok/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import roofline
import serve
import throughput
import trio
from common import print_table, write_json

from trio_llm.testing.server_process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput.add_workload_args(parser)
    parser.add_argument("--json", default="bench/results/serve_vs_offline.json")
    args = parser.parse_args()
    args.max_concurrency = 0
    args.request_rate = float("inf")
    args.prompt_format = "tokens"
    args.tokenizer_dir = None

    server_args = [
        "--model", args.model,
        "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="trio-llm-bench-")) / "server.log"
    with ServerProcess(server_args, log_path=log) as server:
        args.base_url = server.url
        args.label = f"trio_llm server ({args.dtype})"
        prompts = serve.load_prompts(args)
        online = trio.run(serve.run, args, prompts)
    offline = throughput.run(args)
    gflops = roofline.gemm_gflops()
    prompt_tokens = offline["prompt_tokens"]
    ceiling = roofline.tokens_per_second(gflops, prompt_tokens, offline["output_tokens"])
    output_share = offline["output_tokens"] / (prompt_tokens + offline["output_tokens"])

    online_row = {**online, "requests": online["completed"]}
    print(
        f"\nworkload: {args.num_prompts} requests x {args.input_len} prompt tokens -> "
        f"{args.output_len} output tokens, all sent at once; {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print_table([online_row, offline], throughput.COLUMNS)
    ratio = online["output_tok_per_s"] / offline["output_tok_per_s"]
    print(f"server / offline output throughput: {ratio:.3f}")
    print(
        f"roofline (fp32 GEMM {gflops:.0f} GFLOP/s measured now): {ceiling:.0f} total tok/s = "
        f"{ceiling * output_share:.0f} output tok/s; offline reaches "
        f"{offline['total_tok_per_s'] / ceiling:.0%} of it"
    )
    ttft, itl = online["ttft_s"], online["itl_s"]
    print(
        f"server TTFT median {ttft['median']:.2f} s, p99 {ttft['p99']:.2f} s; "
        f"ITL median {itl['median'] * 1000:.0f} ms, p99 {itl['p99'] * 1000:.0f} ms"
    )
    if online["errors"]:
        print(f"server errors: {online['errors']} (first: {online['first_error']})")
    write_json(
        args.json,
        {
            "server": online,
            "offline": offline,
            "ratio": ratio,
            "gemm_gflops": gflops,
            "roofline_total_tok_per_s": ceiling,
            "args": vars(args),
        },
    )


if __name__ == "__main__":
    main()
