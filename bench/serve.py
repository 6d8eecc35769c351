"""Online serving benchmark against any OpenAI-compatible server (streaming completions).

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --input-len 250 --output-len 128

Prompts are sonnet lines cut to ``--input-len`` tokens (sent as token ids, or as text with
``--prompt-format text``). Each request asks for ``--output-len`` tokens with
``ignore_eos`` so the output length is fixed where the server honours it; the tokens
actually produced are counted from the usage chunk (or from chunks when a server sends
none) and the real count is what the throughput uses. Prints req/s, output tok/s, TTFT and
ITL (mean / median / p99), errors; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import print_table, rates, sonnet_prompts, summary, write_json

from tests.support.sse import DONE, delta_text, open_events
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str = ""


async def one_request(
    client: httpx.AsyncClient, body: dict, result: RequestResult, path: str = "/v1/completions"
) -> None:
    """Send one streaming request to ``path``; fill ``result`` (times in seconds).

    Output tokens come from the usage chunk when the server sends one, else one token per
    content chunk.
    """
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with open_events(client, path, body) as events:
            async for event in events:
                if event == DONE:
                    break
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                if delta_text(event):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        result.error = repr(exc)
        return
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = True


async def run(args: argparse.Namespace, prompts: list) -> dict:
    results = [RequestResult() for _ in prompts]
    limit = trio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:

        async def send(i: int) -> None:
            async with limit:
                body = {
                    "model": args.model,
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
                if math.isfinite(args.request_rate):
                    await trio.sleep(rng.expovariate(args.request_rate))
        elapsed = time.perf_counter() - start

    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(len(p) if isinstance(p, list) else 0 for p in prompts)
    itls = [x for r in done for x in r.itls]
    return {
        "system": args.label,
        "base_url": args.base_url,
        **tally(results),
        **rates(len(done), prompt_tokens, output_tokens, elapsed),
        "expected_output_tokens": len(prompts) * args.output_len,
        "ttft_s": summary([r.ttft for r in done]),
        "itl_s": summary(itls),
        "e2e_latency_s": summary([r.latency for r in done]),
        "per_request": [asdict(r) | {"itls": None} for r in results],
    }


def tally(results: list[RequestResult]) -> dict:
    """``requests``, ``completed``, ``errors`` and the ``first_error`` of a run."""
    completed = sum(r.ok for r in results)
    return {
        "requests": len(results),
        "completed": completed,
        "errors": len(results) - completed,
        "first_error": next((r.error for r in results if r.error), ""),
    }


def load_prompts(args: argparse.Namespace) -> list:
    model_dir = args.tokenizer_dir or resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    tokenizer = Tokenizer.load(model_dir)
    prompts = sonnet_prompts(tokenizer, args.num_prompts, args.input_len, seed=args.seed)
    if args.prompt_format == "text":
        return [tokenizer.decode(p) for p in prompts]
    return prompts


def report(result: dict) -> None:
    row = {
        **{
            k: result[k] for k in ("system", "completed", "errors", "req_per_s", "output_tok_per_s")
        },
        "ttft_med_s": result["ttft_s"]["median"],
        "ttft_p99_s": result["ttft_s"]["p99"],
        "itl_med_s": result["itl_s"]["median"],
        "itl_p99_s": result["itl_s"]["p99"],
    }
    print_table([row], list(row))
    if result["output_tokens"] != result["expected_output_tokens"]:
        print(
            f"note: {result['output_tokens']} output tokens produced, "
            f"{result['expected_output_tokens']} asked for"
        )
    if result["first_error"]:
        print("first error:", result["first_error"])


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the `model` field to send")
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer for the prompts")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson")
    parser.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens")
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--label", default="server")
    parser.add_argument("--json", help="also write the result here")
    add_client_args(parser)
    args = parser.parse_args()
    result = trio.run(run, args, load_prompts(args))
    report(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
