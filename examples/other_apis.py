"""The same server through Anthropic's Messages API and OpenAI's Responses API.

Usage (with ``make serve`` running)::

    .venv/bin/python examples/other_apis.py [--base-url http://127.0.0.1:8000] [QUESTION]

Prints the answer from each API, streamed from the Messages API.
"""

from __future__ import annotations

import argparse

import anthropic
from openai import OpenAI

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    # Anthropic's SDK: the base URL without /v1; the key goes in x-api-key.
    claude_style = anthropic.Anthropic(base_url=args.base_url, api_key="unused")
    with claude_style.messages.stream(
        model=MODEL,
        max_tokens=args.max_tokens,
        system="Answer in one sentence.",
        messages=[{"role": "user", "content": args.question}],
        extra_body={"temperature": 0},  # the SDK no longer has the keyword; the API has it
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
        final = stream.get_final_message()
    print(f"\n[messages: stop_reason {final.stop_reason}, {final.usage.output_tokens} tokens]")

    # OpenAI's Responses API (stateless: send the whole conversation as input).
    openai = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    response = openai.responses.create(
        model=MODEL,
        instructions="Answer in one sentence.",
        input=args.question,
        max_output_tokens=args.max_tokens,
        temperature=0,
    )
    print(response.output_text)
    print(f"[responses: {response.status}, {response.usage.output_tokens} tokens]")


if __name__ == "__main__":
    main()
