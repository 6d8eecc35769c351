"""The cost of LoRA adapters in a batch: output tok/s of 32 clients with 0, 1 and 3 adapters.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/lora_mix.py [--rank 16] [--clients 32]

Three random adapters of every projection (peft, ``init_lora_weights=False``, ``lora_alpha``
1: answers near the base model's, as a trained adapter's are, rather than random text that
costs the server more to detokenize) are made for the default model. Two servers run with
the same flags (``--server-args``; the default model as it serves by default): one without
``--enable-lora`` (the base model's figure), one with ``--enable-lora --max-loras 3`` and
the adapters as ``--lora-modules``; both run at once, and ``--rounds`` rounds of every load
in turn are measured (the host's noise falls on all loads alike; the median round of each
is shown).
Against the second, ``--num-prompts`` streamed completions (token-id prompts of
``--input-len``, ``--output-len`` tokens each, ``ignore_eos``) with ``--clients`` at once
name: the base model only (0 adapters: the cost of the hooks alone), one adapter, or the
three adapters in turn (each step mixes them). Prints one row per load; ``--json`` writes
everything.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import print_table, rates, summary, write_json
from serve import RequestResult, load_prompts, one_request

from tests.support.lora import save_adapter
from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir


async def run_load(url: str, models: list[str], prompts: list, args: argparse.Namespace) -> dict:
    """``prompts`` streamed with ``args.clients`` at once, request i naming
    ``models[i % len(models)]``: output tok/s, TTFT and ITL."""
    results = [RequestResult() for _ in prompts]
    limit = trio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def send(i: int) -> None:
            async with limit:
                body = {
                    "model": models[i % len(models)],
                    "prompt": prompts[i],
                    "max_tokens": args.output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                await one_request(client, body, results[i])

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(send, i)
        elapsed = time.perf_counter() - start
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    output = sum(r.output_tokens for r in done)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "completed": len(done),
        "errors": errors[:3],
        **rates(len(done), prompt_tokens, output, elapsed),
        "ttft_s": summary([r.ttft for r in done]),
        "itl_s": summary([x for r in done for x in r.itls]),
    }


def make_adapters(folder: Path, rank: int) -> list[Path]:
    """Three random adapters of every projection of the default model."""
    model_dir = resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    return [
        save_adapter(model_dir, folder / f"bench-lora-{i}", seed=i, rank=rank, alpha=1)
        for i in range(3)
    ]


def measure(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    adapters = make_adapters(workdir, args.rank)
    prompts = load_prompts(argparse.Namespace(**vars(args), tokenizer_dir=None, seed=0))
    names = [f"lora{i}" for i in range(3)]
    lora_flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", str(args.rank)]
    lora_flags += ["--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters, strict=True))]
    loads = [
        ("base model, no --enable-lora", 0, [DEFAULT_MODEL]),
        ("--enable-lora, 0 adapters", 1, [DEFAULT_MODEL]),
        ("1 adapter", 1, names[:1]),
        ("3 adapters mixed", 1, names),
    ]
    servers = [
        ServerProcess([*args.server_args.split(), *flags], log_path=workdir / f"{i}.log")
        for i, flags in enumerate([[], lora_flags])
    ]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in loads}
    try:
        for server in servers:
            server.start()
            trio.run(run_load, server.url, [DEFAULT_MODEL], prompts[:8], args)  # warm-up
        # Rounds of every load in turn: the host's own noise falls on all of them alike.
        for _ in range(args.rounds):
            for label, server_index, models in loads:
                url = servers[server_index].url
                runs[label].append(trio.run(run_load, url, models, prompts, args))
    finally:
        for server in servers:
            server.close()
    rows = []
    for label, results in runs.items():
        best = sorted(results, key=lambda r: r["output_tok_per_s"])[len(results) // 2]
        rows.append({"load": label, **best, "rounds": results})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="each load's median is shown")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--server-args",
        default="--max-model-len 1024 --kv-cache-memory 512MiB --no-enable-prefix-caching",
        help="more trio-llm serve flags, one string (both servers; prefix caching is off "
        "so that every load computes its prompts: an adapter's requests never hit blocks "
        "of the base model's)",
    )
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()
    args.model, args.prompt_format = DEFAULT_MODEL, "tokens"
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(args, Path(workdir))
    base = rows[0]["output_tok_per_s"]
    table = [
        {
            "load": row["load"],
            "ok": row["completed"],
            "out tok/s": round(row["output_tok_per_s"], 1),
            "vs base": round(row["output_tok_per_s"] / base, 3),
            "TTFT median s": round(row["ttft_s"]["median"], 3),
            "ITL median ms": round(1000 * row["itl_s"]["median"], 1),
        }
        for row in rows
    ]
    print_table(table, list(table[0]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
