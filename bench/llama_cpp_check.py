"""One greedy generation with llama-cpp-python (`make bench-peers` runs it after the build).

    .venv-peers/bin/python bench/llama_cpp_check.py MODEL.gguf

A build that cannot run on this CPU (ggml's native build on a Xeon with AMX dies at its
first token) fails here, with the exit status of the crash, instead of in a benchmark.
"""

from __future__ import annotations

import sys

from llama_cpp import Llama


def main() -> int:
    model = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
    out = model.create_completion("The capital of France is", max_tokens=8, temperature=0.0)
    text = out["choices"][0]["text"]
    print(f"llama-cpp-python generated {text!r}")
    return 0 if text.strip() else 1


if __name__ == "__main__":
    raise SystemExit(main())
