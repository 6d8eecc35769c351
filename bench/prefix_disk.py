"""Time to first token of a long prompt, cold and read back from the prefix cache's tier
on disk after a server restart, on the other engine of ``-dp 2`` and after the model was
unloaded and loaded again (issue 44).

    .venv/bin/python bench/prefix_disk.py [--prompt-tokens 7000] [--dtype auto] [--no-dp]
    # Claude Code's first request (about 20,000 tokens; `make gemma3` first), two
    # conversations with a restart between them:
    .venv/bin/python bench/prefix_disk.py --claude-code

Starts a server with ``--prefix-cache-dir`` in a fresh folder, sends the prompt once
(cold: nothing on disk), stops the server, starts a new one on the same folder and sends
it again (warm: its blocks read from disk). Then (unless ``--no-dp``) a server of
``--data-parallel-size 2 --keep-alive forever`` in another fresh folder: the prompt on
engine 0 (cold; vLLM's ``X-data-parallel-rank`` header picks the engine), on engine 1
(warm: read from disk), then ``POST /models/unload``, ``POST /models/load`` (timed apart)
and the prompt again (warm: the new engine reads it from disk). Each of the two engines
has one of the two cores, so that case's figures compare with each other, not with the
first one's. Prints each TTFT, the
cached tokens each warm one reported, whether the greedy outputs are identical, and
warm/cold.

With ``--claude-code`` the prompt is Claude Code's recorded first request
(tests/fixtures/claude_code/first_request.json, to ``/v1/messages``) on Gemma 3 270M:
the first conversation says "say hi", the second, after the restart, "say hello"; they
share the system prompt and the 25 tools.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import sonnet_prompts

from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer


def first_token(
    url: str, prompt: list[int], max_tokens: int, rank: int | None = None
) -> dict[str, Any]:
    """One streamed greedy completion (on engine ``rank`` of ``-dp N``): its TTFT (s),
    text and cached prompt tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    text, cached = "", 0
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("choices"):
                ttft = ttft or time.perf_counter() - start
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"ttft": ttft, "text": text, "cached": cached}


FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/claude_code/first_request.json"
GEMMA3_TEMPLATE = Path(__file__).resolve().parent / "data" / "gemma3_tools.jinja"
GEMMA3_FLAGS = [
    *("--model", "gemma-3-270m", "--chat-template", str(GEMMA3_TEMPLATE)),
    *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),  # as `make serve`
]


def claude_code_first(url: str, user_text: str) -> dict[str, Any]:
    """Claude Code's first request of a conversation saying ``user_text``, streamed: its
    TTFT (s) and the prompt tokens read from the cache."""
    body = json.loads(FIXTURE.read_text())["body"]
    body.update(model="gemma-3-270m", max_tokens=16)
    body["messages"][0]["content"][-1]["text"] = user_text
    start = time.perf_counter()
    ttft, cached, text = None, 0, ""
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=1200) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "message_start":
                cached = event["message"]["usage"].get("cache_read_input_tokens", 0)
            elif event.get("type") == "error":
                raise RuntimeError(f"error event: {event}")
            elif event.get("type") in ("content_block_start", "content_block_delta"):
                ttft = ttft or time.perf_counter() - start
                text += event.get("delta", {}).get("text", "")
    return {"ttft": ttft, "text": text, "cached": cached}


def claude_code(folder: str) -> None:
    """Two Claude Code conversations' first requests, a server restart between them."""
    flags = [*GEMMA3_FLAGS, "--prefix-cache-dir", str(Path(folder) / "kv")]
    runs = {}
    for name, user in (("first conversation", "say hi"), ("second, restarted", "say hello")):
        with ServerProcess(flags, log_path=Path(folder) / f"{name}.log") as server:
            runs[name] = claude_code_first(server.url, user)
            server.stop()
    print("Claude Code's first request on gemma-3-270m, a restart between two conversations")
    for name, run in runs.items():
        print(f"  {name:22s} TTFT {run['ttft']:7.3f} s   cached tokens {run['cached']}")
    first, second = runs.values()
    print(f"  second/first: {second['ttft'] / first['ttft']:.3f}")


def data_parallel(flags: list[str], prompt: list[int], max_tokens: int, folder: Path) -> dict:
    """The ``-dp 2`` case: cold on engine 0, warm on engine 1, warm after an unload."""
    kv = folder / "kv-dp"
    flags = [*flags, "--prefix-cache-dir", str(kv), "-dp", "2", "--keep-alive", "forever"]
    runs = {}
    with ServerProcess(flags, log_path=folder / "dp.log") as server:
        runs["cold, -dp 2 engine 0"] = first_token(server.url, prompt, max_tokens, rank=0)
        wanted = (len(prompt) - 1) // 16
        while len(list(kv.rglob("*.kv"))) < wanted:  # the writer's pace
            time.sleep(0.05)
        runs["warm, the other engine"] = first_token(server.url, prompt, max_tokens, rank=1)
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        httpx.post(f"{server.url}/models/unload", json={"model": model}, timeout=600)
        start = time.perf_counter()  # the load, timed apart from the prompt's TTFT
        loaded = httpx.post(f"{server.url}/models/load", json={"model": model}, timeout=600)
        loaded.raise_for_status()
        load_seconds = time.perf_counter() - start
        runs["warm, after an unload"] = first_token(server.url, prompt, max_tokens, rank=0)
        runs["warm, after an unload"]["load"] = load_seconds
        server.stop()
    return runs


def report(runs: dict[str, dict[str, Any]]) -> None:
    """Each run's TTFT and cached tokens; each warm one's ratio to the cold one before
    it, and whether its output is the cold one's."""
    cold = None
    for name, run in runs.items():
        if name.startswith("cold"):
            cold = run
            extra = ""
        else:
            assert cold is not None
            same = run["text"] == cold["text"]
            extra = f"   warm/cold {run['ttft'] / cold['ttft']:.3f}   identical: {same}"
            if "load" in run:
                extra += f"   (loaded first by POST /models/load: {run['load']:.2f} s)"
        print(f"  {name:24s} TTFT {run['ttft']:7.3f} s   cached {run['cached']:5d}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--claude-code", action="store_true")
    parser.add_argument("--no-dp", action="store_true", help="skip the -dp 2 case")
    args = parser.parse_args()
    if args.claude_code:
        with tempfile.TemporaryDirectory() as folder:
            claude_code(folder)
        return
    tokenizer = Tokenizer.load(resolve_model_dir(DEFAULT_MODEL, default_cache_dir()))
    [prompt] = sonnet_prompts(tokenizer, 1, args.prompt_tokens, seed=44)
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.prompt_tokens + 512)]
    with tempfile.TemporaryDirectory() as folder:
        flags += ["--prefix-cache-dir", str(Path(folder) / "kv")]
        runs = {}
        for name in ("cold", "warm, after a restart"):
            with ServerProcess(flags, log_path=Path(folder) / f"{name}.log") as server:
                runs[name] = first_token(server.url, prompt, args.max_tokens)
                server.stop()
        size = sum(p.stat().st_size for p in (Path(folder) / "kv").rglob("*.kv"))
        print(f"prompt: {len(prompt)} tokens, --dtype {args.dtype}; {size / 2**20:.0f} MiB on disk")
        report(runs)
        if not args.no_dp:
            report(data_parallel(flags[:4], prompt, args.max_tokens, Path(folder)))


if __name__ == "__main__":
    main()
