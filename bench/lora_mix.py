"""The cost of LoRA adapters in a batch: output tok/s of 32 clients with 0, 1 and 3 adapters.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/lora_mix.py [--rank 16] [--clients 32]

Three random adapters of every projection (peft, ``init_lora_weights=False``) are made for
the default model. Two servers run in turn with the same flags (``--server-args``; the
default model as it serves by default): one without ``--enable-lora`` (the base model's
figure), one with ``--enable-lora --max-loras 3`` and the adapters as ``--lora-modules``.
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
        save_adapter(model_dir, folder / f"bench-lora-{i}", seed=i, rank=rank, alpha=rank)
        for i in range(3)
    ]


def measure(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    adapters = make_adapters(workdir, args.rank)
    prompts = load_prompts(argparse.Namespace(**vars(args), tokenizer_dir=None, seed=0))
    names = [f"lora{i}" for i in range(3)]
    lora_flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", str(args.rank)]
    lora_flags += ["--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters, strict=True))]
    loads = [
        ("base model, no --enable-lora", [], [DEFAULT_MODEL]),
        ("--enable-lora, 0 adapters", lora_flags, [DEFAULT_MODEL]),
        ("1 adapter", lora_flags, names[:1]),
        ("3 adapters mixed", lora_flags, names),
    ]
    rows = []
    server: ServerProcess | None = None
    for i, (label, flags, models) in enumerate(loads):
        if i < 2:  # a server per flag set, kept for the loads after it
            if server is not None:
                server.close()
            server_args = [*args.server_args.split(), *flags]
            server = ServerProcess(server_args, log_path=workdir / f"{i}.log")
            server.start()
        assert server is not None
        trio.run(run_load, server.url, models, prompts[:8], args)  # warm-up
        result = trio.run(run_load, server.url, models, prompts, args)
        rows.append({"load": label, **result})
    if server is not None:
        server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
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
