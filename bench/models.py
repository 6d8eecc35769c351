"""One model's serving figures: output tok/s at 1 and 32 concurrent clients (its KV
memory figures: bench/kv_memory.py).

    python bench/models.py --model gemma-3-270m --dtype float32

Starts ``trio-llm serve --model M`` itself (or measures ``--base-url``), then sends
``--requests-1`` requests one at a time and ``--requests-32`` requests 32 at once
(streaming completions of ``--input-len`` sonnet tokens, ``--output-len`` tokens each, EOS
ignored; both counts are bounded, so a run takes a minute or two on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import print_table, sonnet_prompts, write_json
from serve import run as run_clients

from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.dtype_choice import resolve_dtype
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def served_name(url: str) -> str:
    """The first model name the server answers to."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(url: str, name: str, prompts: list[list[int]], concurrency: int, args) -> dict:
    """Output tok/s (and TTFT / ITL medians) of ``prompts`` at ``concurrency``."""
    client_args = argparse.Namespace(
        base_url=url,
        label=f"{concurrency} client(s)",
        model=name,
        output_len=args.output_len,
        max_concurrency=concurrency,
        request_rate=math.inf,
        seed=args.seed,
    )
    result = trio.run(run_clients, client_args, prompts)
    return {
        "clients": concurrency,
        "requests": result["requests"],
        "errors": result["errors"],
        "output_tok_per_s": result["output_tok_per_s"],
        "ttft_med_s": result["ttft_s"]["median"],
        "itl_med_s": result["itl_s"]["median"],
        "elapsed_s": result["elapsed_s"],
        "first_error": result["first_error"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--base-url", default=None, help="measure this server instead")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests-1", type=int, default=4, help="requests at 1 client")
    parser.add_argument("--requests-32", type=int, default=32, help="requests at 32 clients")
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    model_dir = resolve_model_dir(args.model, default_cache_dir())  # converts once
    config = json.loads((model_dir / "config.json").read_text())
    dtype = resolve_dtype(args.dtype, args.device)
    print(f"{args.model} ({config.get('model_type')}, {dtype}): {model_dir}")

    tokenizer = Tokenizer.load(model_dir)
    prompts = sonnet_prompts(tokenizer, args.requests_1 + args.requests_32, args.input_len)
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device]
    flags += ["--max-num-seqs", "32", *args.server_arg]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.base_url is None:
            server = ServerProcess(flags, log_path=Path(tmp) / "server.log")
            server.start()
        url = args.base_url or server.url
        try:
            name = served_name(url)
            rows = [
                measure(url, name, prompts[: args.requests_1], 1, args),
                measure(url, name, prompts[args.requests_1 :], 32, args),
            ]
        finally:
            if server is not None:
                server.stop()
                server.close()
    print_table(rows, [c for c in rows[0] if c != "first_error"])
    for row in rows:
        if row["first_error"]:
            print(f"{row['clients']} client(s): first error: {row['first_error']}")
    write_json(args.json, {"model": args.model, "dtype": dtype, "runs": rows})


if __name__ == "__main__":
    main()
