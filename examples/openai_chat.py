"""Chat with a running trio-llm server through the official openai client, streaming.

make serve                      # in one terminal
.venv/bin/python examples/openai_chat.py "What is the capital of France?"
.venv/bin/python examples/openai_chat.py --base-url http://127.0.0.1:9000 --max-tokens 32 Hi
"""

from __future__ import annotations

import argparse

from openai import OpenAI

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="*", default=["What is the capital of France?"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": " ".join(args.question)}],
        temperature=0,
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens]", flush=True)


if __name__ == "__main__":
    main()
