"""Chat with a running trio-llm server through the official openai client.

make serve                      # in one terminal
.venv/bin/python examples/openai_chat.py "What is the capital of France?"
"""

from __future__ import annotations

import sys

from openai import OpenAI

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def main() -> None:
    question = " ".join(sys.argv[1:]) or "What is the capital of France?"
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=128,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
