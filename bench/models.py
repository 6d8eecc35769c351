"""One model's serving figures: output tok/s at 1 and 32 concurrent clients, KV bytes per
token, and the longest context the default KV memory holds.

    python bench/models.py --model gemma-3-270m --dtype float32
    python bench/models.py --model gemma-3-270m --max-model-len 512   # while windows bind

Starts ``trio-llm serve --model M`` itself (or measures ``--base-url``), then sends
``--requests-1`` requests one at a time and ``--requests-32`` requests 32 at once
(streaming completions of ``--input-len`` sonnet tokens, ``--output-len`` tokens each, EOS
ignored; both counts are bounded, so a run takes a minute or two on a CPU). The KV figures
come from the converted folder's ``config.json`` and the default ``--kv-cache-memory``:
today the engine keeps every layer's keys and values for the whole context (the longest
context is also capped by ``max_position_embeddings``); the last figure says how many
tokens a sliding-window model's cache would hold if its windowed layers kept only their
window.
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
from trio_llm.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MODEL, CacheConfig, default_cache_dir
from trio_llm.model_loader import resolve_dtype, resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def kv_figures(config: dict, dtype: str, memory: int, block_size: int) -> dict:
    """KV bytes per token and the longest context ``memory`` holds, from ``config.json``."""
    layers = config["num_hidden_layers"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_layer_token = 2 * kv_heads * head_dim * ITEMSIZE[dtype]  # keys and values
    per_token = layers * per_layer_token
    max_positions = config.get("max_position_embeddings") or math.inf
    kv_tokens = memory // (per_token * block_size) * block_size
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or []
    windowed = layer_types.count("sliding_attention") if window else 0
    if windowed:
        # full layers hold the whole context; windowed layers at most `window` tokens
        full = layers - windowed
        budget = memory // per_layer_token - windowed * window
        kv_tokens_windowed = budget // full if full else math.inf
    else:
        kv_tokens_windowed = kv_tokens
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sliding_window": window,
        "windowed_layers": windowed,
        "kv_bytes_per_token": per_token,
        "kv_memory": memory,
        "kv_cache_tokens": kv_tokens,
        "max_position_embeddings": config.get("max_position_embeddings"),
        "max_context": min(kv_tokens, max_positions),
        "kv_cache_tokens_if_windowed_layers_kept_only_their_window": kv_tokens_windowed,
    }


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
    kv = kv_figures(config, dtype, DEFAULT_KV_CACHE_MEMORY, CacheConfig.block_size)
    print(f"{args.model} ({config.get('model_type')}, {dtype}): {model_dir}")
    for key, value in kv.items():
        print(f"  {key}: {value}")

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
    write_json(args.json, {"model": args.model, "dtype": dtype, "kv": kv, "runs": rows})


if __name__ == "__main__":
    main()
