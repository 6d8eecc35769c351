"""The engine inside a Trio application, next to the application's own tasks.

    .venv/bin/python examples/embed_trio.py
    .venv/bin/python examples/embed_trio.py --max-tokens 64 --deadline 1.5

A heartbeat task keeps ticking while the model loads and generates (the engine runs in a
child process, so the event loop stays free). The program streams one chat answer, then
starts a long generation and cancels it after ``--deadline`` seconds with
`trio.move_on_after`: leaving the ``async with engine.generate(...)`` block aborts the
request in the engine at once, and the program prints what it got until then.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import trio

from trio_llm import DEFAULT_MODEL, SamplingParams, open_engine


async def heartbeat(interval: float) -> None:
    """The application's own work: a tick every ``interval`` seconds."""
    ticks = 0
    while True:
        await trio.sleep(interval)
        ticks += 1
        print(f"[heartbeat {ticks}]", flush=True)


async def main(args: argparse.Namespace) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat, args.heartbeat)
        async with open_engine(
            args.model, max_model_len=args.max_model_len, num_threads=args.num_threads
        ) as engine:
            print(f"engine ready: {engine.info.dtype}, context {engine.max_model_len} tokens")

            # 1. Stream a chat answer to its end.
            question = [{"role": "user", "content": args.question}]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
            print(f"Q: {args.question}\nA: ", end="", flush=True)
            async with engine.generate(question, params) as answer:
                async for out in answer:
                    print(out.text, end="", flush=True)
            print(f"\n[finish: {answer.finish_reason}, {answer.num_output_tokens} tokens]")

            # 2. A long generation cut short by a deadline.
            story = SamplingParams(max_tokens=args.long_tokens, temperature=0, ignore_eos=True)
            text, num_tokens, finish = "", 0, None
            with trio.move_on_after(args.deadline) as deadline:
                async with engine.generate("Once upon a time", story) as outputs:
                    async for out in outputs:
                        text += out.text
                        num_tokens, finish = out.num_output_tokens, out.finish_reason
            if deadline.cancelled_caught:
                finish = "cancelled"  # the request was aborted in the engine
            print(f"after {args.deadline} s: {text[:200]!r}")
            print(f"[finish: {finish}, {num_tokens} of {args.long_tokens} tokens]")
        nursery.cancel_scope.cancel()  # stop the heartbeat


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of the answer")
    parser.add_argument(
        "--long-tokens", type=int, default=1000, help="tokens the cancelled generation asks for"
    )
    parser.add_argument("--deadline", type=float, default=1.0, help="seconds before cancelling")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between ticks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None)
    return parser.parse_args()


if __name__ == "__main__":
    trio.run(main, parse_args())
