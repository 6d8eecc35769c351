"""What a flood of background responses costs a newcomer (issue 41, item 10).

    python bench/background_flood.py [--flood 60] [--max-tokens 256] [--deadline 60]
        [--no-restart] [--pythonpath CHECKOUT] [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve --max-num-seqs 16`` with a SQLite store in a temporary folder
(and the flags given after ``--``), then a client sends ``--flood`` background responses
(``background: true``, ``--max-tokens`` output tokens each, ``ignore_eos``) within about
a second and leaves; a newcomer then sends one streamed chat request: its time to first
token (TTFT), or "none" when none came within ``--deadline`` seconds. Then (unless
``--no-restart``) the server is stopped with SIGINT, which leaves the background
responses in the store, and another is started on the same store: it resumes them, and
the newcomer's TTFT is measured again. Printed: how many background responses were
accepted and refused (429), and the TTFTs. ``--pythonpath /work/main`` runs another
checkout's server (before/after figures; run it from outside this checkout, e.g. ``cd
/tmp``, or the server imports this checkout's package from the working directory).
Figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import parse_server_args, print_table, server_env, write_json

from tests.support.server_process import ServerProcess

COUNTING = "Count from 1 to 1000, one number per line, with no other text."
PROBE = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}


async def flood(url: str, count: int, max_tokens: int) -> dict[str, int]:
    """``count`` background responses sent at once; the count of each HTTP status."""
    statuses: dict[str, int] = {}
    body = {"input": COUNTING, "background": True, "max_output_tokens": max_tokens}
    body |= {"ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> None:
        reply = await client.post("/v1/responses", json=body)
        statuses[str(reply.status_code)] = statuses.get(str(reply.status_code), 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one, client)
    return statuses


async def newcomer_ttft(url: str, deadline: float) -> float | None:
    """A streamed chat's seconds to its first content token; None past ``deadline``."""
    began = time.perf_counter()
    with trio.move_on_after(deadline):
        async with httpx.AsyncClient(base_url=url, timeout=deadline + 10) as client:
            body = PROBE | {"stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for text in response.aiter_lines():
                    if text.startswith("data: {"):
                        delta = json.loads(text[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            return time.perf_counter() - began
    return None


def server_on(folder: Path, args: argparse.Namespace, name: str) -> ServerProcess:
    """The server (started by ``with``) on the store in ``folder``."""
    flags = ["--max-num-seqs", "16", "--store-url", f"sqlite:///{folder}/store.db"]
    return ServerProcess(
        [*flags, *args.server_flags], log_path=folder / f"{name}.log", env=server_env(args)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=60, help="background responses sent")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens of each")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds to wait")
    parser.add_argument("--no-restart", action="store_true", help="skip the restart")
    args = parse_server_args(parser)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trio-llm-flood-bench-") as name:
        folder = Path(name)
        with server_on(folder, args, "first") as server:
            trio.run(newcomer_ttft, server.url, args.deadline)  # warm-up
            began = time.perf_counter()
            result["statuses"] = trio.run(flood, server.url, args.flood, args.max_tokens)
            result["flood_seconds"] = time.perf_counter() - began
            result["ttft_s"] = trio.run(newcomer_ttft, server.url, args.deadline)
            server.stop()  # SIGINT: the background responses stay in the store
        if not args.no_restart:
            with server_on(folder, args, "second") as server:
                result["ttft_after_restart_s"] = trio.run(newcomer_ttft, server.url, args.deadline)
    rows = [{"status": status, "responses": n} for status, n in sorted(result["statuses"].items())]
    print_table(rows, ["status", "responses"])
    print(f"\nsent in {result['flood_seconds']:.2f} s")
    for key in ("ttft_s", "ttft_after_restart_s"):
        if key in result:
            value = result[key]
            shown = f"{value:.2f} s" if value is not None else f"none within {args.deadline:g} s"
            print(f"newcomer {key.removesuffix('_s').replace('_', ' ')}: {shown}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
