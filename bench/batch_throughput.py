"""Batch throughput, and what a running batch costs interactive requests (issue 34).

    python bench/batch_throughput.py [--lines 500] [--max-tokens 64] [--probes 10]
        [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve`` with a store in a temporary folder (and the flags given after
``--``), then:

1. *idle*: ``--probes`` interactive streamed chat requests, one after another, on the idle
   server: their time to first token (TTFT);
2. *batch*: uploads a ``/v1/completions`` batch of ``--lines`` lines (sonnet prompts,
   ``--max-tokens`` output tokens each, ``ignore_eos``), and from its creation to its
   completion sends the same interactive requests, one after another: their TTFT under
   the batch.

Printed: the batch's lines/s and output tokens/s (from creation to completion, seen by
polling every 0.2 s), and the interactive TTFT (median, p90) idle and during the batch,
with their ratio. Batch lines run below interactive requests only where the engine's
scheduler reads the batch lane (``scope["trio_llm.lane"]``); otherwise they compete
first come, first served. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import parse_server_args, percentile, print_table, server_env, write_json

from tests.support.server_process import ServerProcess

SONNETS = Path(__file__).resolve().parent / "data" / "sonnet.txt"
PROBE = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}


def batch_input(lines: int, max_tokens: int) -> bytes:
    """``lines`` batch lines, each a sonnet line as the prompt."""
    verses = [verse for verse in SONNETS.read_text().splitlines() if verse.strip()]
    rows = []
    for i in range(lines):
        body = {"prompt": verses[i % len(verses)], "max_tokens": max_tokens, "ignore_eos": True}
        rows.append(
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}
        )
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


async def ttft(client: httpx.AsyncClient) -> float:
    """One streamed chat request's seconds to its first content token."""
    began = time.perf_counter()
    body = PROBE | {"stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for text in response.aiter_lines():
            if not text.startswith("data: {"):
                continue
            delta = json.loads(text[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return time.perf_counter() - began
    raise RuntimeError("the probe produced no content")


async def probes(client: httpx.AsyncClient, count: int | None, stop: trio.Event) -> list[float]:
    """TTFTs of probes sent one after another: ``count`` of them, or until ``stop``."""
    times: list[float] = []
    while (count is None or len(times) < count) and not stop.is_set():
        times.append(await ttft(client))
    return times


async def run_batch(client: httpx.AsyncClient, data: bytes) -> tuple[dict[str, Any], float]:
    """Upload ``data``, run it as a batch; the final Batch object and its seconds."""
    files = {"file": ("input.jsonl", data)}
    upload = (await client.post("/v1/files", files=files, data={"purpose": "batch"})).json()
    began = time.perf_counter()
    request = {"input_file_id": upload["id"], "endpoint": "/v1/completions"}
    created = await client.post("/v1/batches", json=request | {"completion_window": "24h"})
    batch = created.json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        await trio.sleep(0.2)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    return batch, time.perf_counter() - began


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await ttft(client)  # warm-up
        idle = await probes(client, args.probes, trio.Event())
        done = trio.Event()
        under: list[float] = []
        async with trio.open_nursery() as nursery:

            async def probe_while_running() -> None:
                under.extend(await probes(client, None, done))

            nursery.start_soon(probe_while_running)
            batch, seconds = await run_batch(client, batch_input(args.lines, args.max_tokens))
            done.set()
        output = await client.get(f"/v1/files/{batch['output_file_id']}/content")
        tokens = sum(
            json.loads(row)["response"]["body"]["usage"]["completion_tokens"]
            for row in output.text.splitlines()
        )
    return {
        "status": batch["status"],
        "lines": batch["request_counts"]["completed"],
        "seconds": seconds,
        "lines_per_s": batch["request_counts"]["completed"] / seconds,
        "output_tok_per_s": tokens / seconds,
        "ttft_idle_median": statistics.median(idle),
        "ttft_idle_p90": percentile(idle, 90),
        "ttft_batch_median": statistics.median(under) if under else None,
        "ttft_batch_p90": percentile(under, 90) if under else None,
        "probes_during_batch": len(under),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=500, help="lines of the batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per line")
    parser.add_argument("--probes", type=int, default=10, help="idle TTFT probes")
    args = parse_server_args(parser)
    with tempfile.TemporaryDirectory(prefix="trio-llm-batch-bench-") as folder:
        flags = ["--store-url", f"sqlite:///{folder}/store.db", *args.server_flags]
        server = ServerProcess(flags, log_path=Path(folder) / "server.log", env=server_env(args))
        with server:
            result = trio.run(measure, server.url, args)
    print_table(
        [result],
        ["status", "lines", "seconds", "lines_per_s", "output_tok_per_s", "probes_during_batch"],
    )
    print()
    rows = [
        {"ttft": "idle", "median_s": result["ttft_idle_median"], "p90_s": result["ttft_idle_p90"]},
        {
            "ttft": "during batch",
            "median_s": result["ttft_batch_median"],
            "p90_s": result["ttft_batch_p90"],
        },
    ]
    print_table(rows, ["ttft", "median_s", "p90_s"])
    if result["ttft_batch_median"]:
        ratio = result["ttft_batch_median"] / result["ttft_idle_median"]
        print(f"\nmedian TTFT during the batch / idle: {ratio:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
