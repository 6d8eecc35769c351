"""--data-parallel-size: the same load against 1 and N engines under one server.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/data_parallel.py [--sizes 1 2]

For each size a server is started (loopback, port 0) and measured in turn:

- one client (``--single-prompts`` streamed completions): ITL, where each engine of N
  gets 1/N of the cores on a CPU;
- ``--clients`` concurrent clients (``--num-prompts`` streamed completions, token-id
  prompts of ``--input-len``, ``--output-len`` tokens each): output tok/s, TTFT, ITL,
  and how the requests spread over the engines (``request_success_total`` by engine);
- shared prefixes: ``--shared-requests`` chat requests over ``--num-prefixes`` long system
  prompts, 4 at a time: the prefix-cache hit rate over all engines. With one engine it
  is the best any routing can do; prefix-aware routing should come close to it with N.

Prints one row per size; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import print_table, write_json
from serve import load_prompts
from serve import run as run_load

from tests.support.metrics_scrape import per_engine
from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL


def scrape(url: str, name: str) -> dict[str, float]:
    """``trio_llm:<name>`` summed by ``engine`` label."""
    return per_engine(httpx.get(f"{url}/metrics", timeout=30).text, name)


async def shared_prefixes(url: str, args: argparse.Namespace) -> float:
    """The prefix-cache hit rate of chat requests over a few long system prompts."""
    sonnet = (Path(__file__).parent / "data" / "sonnet.txt").read_text().splitlines()
    prefixes = [
        f"Poem {i}. " + " ".join(sonnet[(i * 20) % len(sonnet) :][:20])
        for i in range(args.num_prefixes)
    ]
    before = sum(scrape(url, "prefix_cache_queries_total").values())
    hits_before = sum(scrape(url, "prefix_cache_hits_total").values())
    limiter = trio.CapacityLimiter(4)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        async with limiter:
            body = {
                "model": args.model,
                "messages": [
                    {"role": "system", "content": prefixes[i % len(prefixes)]},
                    {"role": "user", "content": f"Question {i}: what is line {i} about?"},
                ],
                "max_tokens": 2,
            }
            (await http.post("/v1/chat/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async with trio.open_nursery() as nursery:
            for i in range(args.shared_requests):
                nursery.start_soon(one, http, i)
    queries = sum(scrape(url, "prefix_cache_queries_total").values()) - before
    hits = sum(scrape(url, "prefix_cache_hits_total").values()) - hits_before
    return hits / max(queries, 1.0)


def load_args(args: argparse.Namespace, url: str, prompts: int, clients: int) -> argparse.Namespace:
    return argparse.Namespace(
        model=args.model,
        num_prompts=prompts,
        output_len=args.output_len,
        max_concurrency=clients,
        request_rate=float("inf"),
        seed=0,
        base_url=url,
        label="",
    )


def measure(size: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start a server with ``size`` engines and run the three loads against it."""
    server_args = ["--data-parallel-size", str(size), *args.server_args.split()]
    server = ServerProcess(server_args, log_path=log_dir / f"dp{size}.log")
    server.start()
    try:
        url = server.url
        prompts = load_prompts(argparse.Namespace(**vars(args), tokenizer_dir=None, seed=0))
        single = trio.run(run_load, load_args(args, url, 1, 1), prompts[: args.single_prompts])
        before = scrape(url, "request_success_total")
        many = trio.run(run_load, load_args(args, url, len(prompts), args.clients), prompts)
        after = scrape(url, "request_success_total")
        spread = {engine: after[engine] - before.get(engine, 0.0) for engine in sorted(after)}
        hit_rate = trio.run(shared_prefixes, url, args)
    finally:
        server.close()
    return {
        "data_parallel_size": size,
        "single_client": single,
        "many_clients": many,
        "requests_per_engine": spread,
        "shared_prefix_hit_rate": hit_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--single-prompts", type=int, default=4)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=7)
    parser.add_argument("--shared-requests", type=int, default=48)
    parser.add_argument(
        "--server-args",
        default="--max-model-len 1024 --kv-cache-memory 512MiB",
        help="more trio-llm serve flags, one string",
    )
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()
    args.prompt_format = "tokens"
    results = []
    with tempfile.TemporaryDirectory() as log_dir:
        for size in args.sizes:
            results.append(measure(size, args, Path(log_dir)))
    rows = []
    for result in results:
        single, many = result["single_client"], result["many_clients"]
        spread = result["requests_per_engine"]
        rows.append(
            {
                "engines": result["data_parallel_size"],
                "c1_itl_med_ms": round(single["itl_s"]["median"] * 1000, 1),
                f"c{args.clients}_out_tok_s": round(many["output_tok_per_s"], 1),
                f"c{args.clients}_ttft_med_s": round(many["ttft_s"]["median"], 2),
                f"c{args.clients}_itl_med_ms": round(many["itl_s"]["median"] * 1000, 1),
                "errors": single["errors"] + many["errors"],
                "requests_per_engine": "/".join(f"{spread[e]:.0f}" for e in sorted(spread)),
                "prefix_hit_rate": f"{result['shared_prefix_hit_rate']:.1%}",
            }
        )
    print_table(rows, list(rows[0]))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
