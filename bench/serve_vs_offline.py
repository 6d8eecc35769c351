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

import serve  # noqa: E402
import throughput  # noqa: E402
import trio  # noqa: E402
from common import print_table, write_json  # noqa: E402

from trio_llm.testing.server_process import ServerProcess  # noqa: E402


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

    columns = ["system", "requests", "elapsed_s", "req_per_s", "output_tok_per_s", "total_tok_per_s"]
    online_row = {**online, "requests": online["completed"]}
    print(f"\nworkload: {args.num_prompts} requests x {args.input_len} prompt tokens -> "
          f"{args.output_len} output tokens, all sent at once; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    print_table([online_row, offline], columns)
    ratio = online["output_tok_per_s"] / offline["output_tok_per_s"]
    print(f"server / offline output throughput: {ratio:.3f}")
    print(
        f"server TTFT median {online['ttft_s']['median']:.2f} s, p99 {online['ttft_s']['p99']:.2f} s; "
        f"ITL median {online['itl_s']['median'] * 1000:.0f} ms, p99 {online['itl_s']['p99'] * 1000:.0f} ms"
    )
    if online["errors"]:
        print(f"server errors: {online['errors']} (first: {online['first_error']})")
    write_json(args.json, {"server": online, "offline": offline, "ratio": ratio, "args": vars(args)})


if __name__ == "__main__":
    main()
