"""One user's ITL by context length and KV cache dtype (issue 42, item 4).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/kv_cache_dtype.py [--kv float32 auto]
        [--contexts 256 4096 7000] [--rounds 3] [--repeats 2] [-- more serve flags]

For each ``--kv`` value, ``--repeats`` times, interleaved: starts ``trio-llm serve -q gguf
--dtype float32 --max-model-len 8192 --kv-cache-dtype KV`` (the default model), sends per
context length ``--rounds`` streamed greedy completions of a prompt of about that many
tokens (new text each round, so no prefix cache serves them) with 32 output tokens, and
prints the median over the rounds of each request's median inter-token latency (ms), and
the KV cache line of the engine's start-up log. Figures only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Times computing: no prompt blocks an earlier run left on disk.
os.environ.setdefault("TRIO_LLM_PREFIX_CACHE_DIR", "none")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORDS = "the quick brown fox jumps over a lazy dog near the river bank while birds sing".split()


def _wait_ready(url: str, server: subprocess.Popen[bytes], seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start in time")


def _itl_ms(url: str, prompt: str) -> float:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 32,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return statistics.median(b - a for a, b in itertools.pairwise(times[1:])) * 1000


def measure(kv: str, contexts: list[int], rounds: int, port: int, extra: list[str]) -> None:
    """Print one server's ITL by context (see the module doc)."""
    log = Path(tempfile.mkdtemp()) / "server.log"
    argv = [sys.executable, "-m", "trio_llm", "serve", "--port", str(port), "-q", "gguf"]
    argv += ["--dtype", "float32", "--max-model-len", "8192", "--kv-cache-dtype", kv]
    argv += ["--disable-access-log", *extra]
    with log.open("w") as sink:
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, server)
        figures = {}
        for context in contexts:
            itls = []
            for r in range(rounds):
                words = (WORDS[(i * 7 + r) % len(WORDS)] for i in range(int(context * 0.95)))
                itls.append(_itl_ms(url, f"{kv} {r} " + " ".join(words)))
            figures[context] = round(statistics.median(itls), 1)
    finally:
        server.terminate()
        server.wait()
    cache = [line for line in log.read_text().splitlines() if "KV cache:" in line]
    print(f"--kv-cache-dtype {kv}: c=1 ITL ms by context {figures}", flush=True)
    print(f"    {cache[0].split('KV cache: ', 1)[-1] if cache else '(no KV cache line)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", nargs="+", default=["float32", "auto"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 4096, 7000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("extra", nargs="*", help="more serve flags (after --)")
    args = parser.parse_args()
    for _ in range(args.repeats):
        for kv in args.kv:
            measure(kv, args.contexts, args.rounds, args.port, args.extra)


if __name__ == "__main__":
    main()
