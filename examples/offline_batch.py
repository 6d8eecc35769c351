"""Offline batch generation from synchronous code with `trio_llm.LLM`.

    .venv/bin/python examples/offline_batch.py
    .venv/bin/python examples/offline_batch.py --max-tokens 48

Every prompt is submitted at once, so the engine batches them; the results come back in
prompt order. A prompt is a text, a list of chat messages, or a list of token ids.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trio_llm import DEFAULT_MODEL, LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    "def fibonacci(n):",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    with LLM(args.model, max_model_len=args.max_model_len, num_threads=args.num_threads) as llm:
        results = llm.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        print(f"{shown!r}\n  -> {result.text.strip()!r}")
        print(f"  [{len(result.token_ids)} tokens, finish: {result.finish_reason}]")


if __name__ == "__main__":
    main()
