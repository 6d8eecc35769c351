"""What a large conversation costs the store and the server (issue 41, item 9).

    python bench/conversation_growth.py [--items 600] [--item-kb 20] [--responses 2]
        [--pythonpath CHECKOUT] [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve`` with a SQLite store in a temporary folder (and the flags given
after ``--``), then builds one conversation of ``--items`` reasoning items of
``--item-kb`` kB each (20 items a request, OpenAI's limit; reasoning items are never
shown to the model, so the prompt stays small), and sends ``--responses`` responses that
use it (2 output tokens each). Printed: the store's file size and the bytes its
``responses.context`` column holds (the copies of the conversation a response stores)
before and after the responses, the API server's resident memory, each response's
seconds, and the seconds of ``GET /v1/responses/{id}/input_items?limit=1``.
``--pythonpath /work/main`` runs another checkout's server (before/after figures; run it
from outside this checkout, e.g. ``cd /tmp``, or the server imports this checkout's
package from the working directory). The limits of a conversation
(``--max-conversation-size``, default 16 MiB) bound what this can build: keep
``--items`` x ``--item-kb`` under it. Figures only.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from common import parse_server_args, print_table, server_env, write_json

from tests.support.server_process import ServerProcess


def store_figures(folder: Path) -> dict[str, int]:
    """The store's file bytes (database and its write-ahead log) and the bytes of the
    responses' stored contexts."""
    files = sum(path.stat().st_size for path in folder.glob("store.db*"))
    with sqlite3.connect(f"file:{folder / 'store.db'}?mode=ro", uri=True) as connection:
        (context,) = connection.execute(
            "SELECT COALESCE(SUM(LENGTH(context)), 0) FROM responses"
        ).fetchone()
    return {"store_file_bytes": files, "stored_context_bytes": int(context)}


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    for text in Path(f"/proc/{pid}/status").read_text().splitlines():
        if text.startswith("VmRSS:"):
            return int(text.split()[1]) * 1024
    return 0


def build_conversation(client: httpx.Client, items: int, item_kb: int) -> str:
    """A conversation of ``items`` reasoning items of ``item_kb`` kB; its id."""
    thought = [{"type": "reasoning_text", "text": "t" * (item_kb * 1024)}]
    item = {"type": "reasoning", "summary": [], "content": thought}
    conversation = client.post("/v1/conversations", json={}).json()["id"]
    for start in range(0, items, 20):
        batch = [item] * min(20, items - start)
        reply = client.post(f"/v1/conversations/{conversation}/items", json={"items": batch})
        reply.raise_for_status()
    return conversation


def measure(url: str, pid: int, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600) as client:
        conversation = build_conversation(client, args.items, args.item_kb)
        before = store_figures(folder)
        seconds, response_id = [], ""
        for turn in range(args.responses):
            body = {"input": f"Turn {turn}: say hi.", "conversation": conversation}
            began = time.perf_counter()
            reply = client.post("/v1/responses", json=body | {"max_output_tokens": 2})
            seconds.append(time.perf_counter() - began)
            reply.raise_for_status()
            response_id = reply.json()["id"]
        began = time.perf_counter()
        page = client.get(f"/v1/responses/{response_id}/input_items", params={"limit": 1})
        page_seconds = time.perf_counter() - began
        page.raise_for_status()
        after = store_figures(folder)
    return {
        "conversation_mib": args.items * args.item_kb / 1024,
        "store_file_mib_before": before["store_file_bytes"] / 2**20,
        "store_file_mib_after": after["store_file_bytes"] / 2**20,
        "stored_context_mib": after["stored_context_bytes"] / 2**20,
        "server_rss_mib": rss_bytes(pid) / 2**20,
        "response_seconds": seconds,
        "input_items_limit_1_seconds": page_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=600, help="reasoning items")
    parser.add_argument("--item-kb", type=int, default=20, help="kB of each item")
    parser.add_argument("--responses", type=int, default=2, help="responses that use it")
    args = parse_server_args(parser)
    with tempfile.TemporaryDirectory(prefix="trio-llm-conversation-bench-") as name:
        folder = Path(name)
        flags = ["--store-url", f"sqlite:///{folder}/store.db", *args.server_flags]
        server = ServerProcess(flags, log_path=folder / "server.log", env=server_env(args))
        with server:
            result = measure(server.url, server.pid, folder, args)
    columns = ["conversation_mib", "store_file_mib_before", "store_file_mib_after"]
    columns += ["stored_context_mib", "server_rss_mib", "input_items_limit_1_seconds"]
    print_table([result], columns)
    print("responses (s):", " ".join(f"{s:.2f}" for s in result["response_seconds"]))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
