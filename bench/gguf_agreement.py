"""The GGUF path held to the same file de-quantized to float32, under teacher forcing, with
llama.cpp's own agreement with that reference beside it (issue 42, build item 1).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gguf_agreement.py [--tokens 128] [--json F]

The reference is trio_llm with ``--dtype float32`` (the GGUF weights de-quantized: greedy
tokens identical to transformers'). It continues each of the mixed prompts below greedily
for ``--tokens`` tokens (``ignore_eos``); every system then reads the same token sequences
(teacher forcing: the reference's tokens, never its own) and reports, at each position of
the continuations, its most likely token and the log-probability of the reference's token.
Printed per system: the positions, the share whose top-1 is the reference's, and the mean /
95th percentile / largest |logprob difference| of the reference's token (nats).

Systems: ``trio gguf (prefill)``: the default (the file's own blocks; the sequence read in
prefill chunks, so the products take many rows at once, on AMX tiles where the CPU has
them); ``trio gguf (2 tokens a step)``: the same with a 2-token step budget, so every
product takes the int8 row kernel of a decode step; ``llama.cpp`` (where ``make
bench-peers`` installed it): llama-cpp-python on the same file, 2 threads, all logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import write_json

from trio_llm.config import DEFAULT_MODEL, default_cache_dir, engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.model_files.named_models import default_gguf_path
from trio_llm.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"

#: Mixed prompts: chat turns (the model's template) and plain text of several kinds.
CHATS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when it is slow.",
    "List five facts about the planet Mars, one per line.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
]
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n",
    "Q: What is 17 times 23?\nA: Let us work it out step by step.",
    "Dear Sir or Madam,\n\nI am writing to complain about the delivery of my order",
]


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of the mixed prompts."""
    chats = [tokenizer.render_chat([{"role": "user", "content": c}]) for c in CHATS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats + TEXTS]


def _run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Every output of each request, in order."""
    outputs: dict[str, list] = {str(i): [] for i in range(len(requests))}
    for i, (tokens, params) in enumerate(requests):
        core.add_request(AddRequest(str(i), tokens, params))
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            outputs[output.request_id].append(output)
    return [outputs[str(i)] for i in range(len(requests))]


def continuations(starts: list[list[int]], tokens: int) -> list[list[int]]:
    """The float32 reference's greedy continuation of each prompt."""
    core = EngineCore.from_config(engine_config(dtype="float32"))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    runs = _run(core, [(start, params) for start in starts])
    core.close()
    return [[t for out in run for t in out.new_token_ids] for run in runs]


def trio_positions(
    sequences: list[list[int]], starts: list[int], **config: object
) -> list[tuple[int, float]]:
    """(top-1 token, logprob of the sequence's token) at each continuation position of each
    sequence (the position predicting token ``starts[i]`` onward), read by trio_llm."""
    core = EngineCore.from_config(engine_config(**config))
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    runs = _run(core, [(sequence, params) for sequence in sequences])
    core.close()
    out = []
    for run, start in zip(runs, starts, strict=True):
        entries = [e for o in run for e in o.prompt_logprobs or []]  # positions 1..n-1
        out += [(e.top_token_ids[0], e.logprob) for e in entries[start - 1 :]]
    return out


LLAMA_CPP_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
out = []
for sequence, start in zip(job["sequences"], job["starts"]):
    llm.reset()
    llm.eval(sequence)
    logits = np.asarray(llm.scores[: len(sequence)], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for p in range(start - 1, len(sequence) - 1):
        out.append([int(logprobs[p].argmax()), float(logprobs[p, sequence[p + 1]])])
json.dump(out, sys.stdout)
"""


def llama_cpp_positions(sequences: list[list[int]], starts: list[int]) -> list | None:
    """As `trio_positions`, read by llama-cpp-python (None where it is not installed)."""
    if not PEERS_PYTHON.exists():
        print(f"skipping llama.cpp: {PEERS_PYTHON} is missing (make bench-peers)")
        return None
    job = {"model": str(default_gguf_path()), "sequences": sequences, "starts": starts}
    result = subprocess.run(
        [str(PEERS_PYTHON), "-c", LLAMA_CPP_SCRIPT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return [tuple(row) for row in json.loads(result.stdout)]


def summary(name: str, reference: list, positions: list) -> dict[str, object]:
    """Agreement of ``positions`` with the ``reference`` (same order)."""
    same = sum(a[0] == b[0] for a, b in zip(reference, positions, strict=True))
    diffs = sorted(abs(a[1] - b[1]) for a, b in zip(reference, positions, strict=True))
    return {
        "system": name,
        "positions": len(positions),
        "top-1 agreement": same / len(positions),
        "mean |dlogprob|": statistics.fmean(diffs),
        "p95 |dlogprob|": diffs[int(0.95 * (len(diffs) - 1))],
        "max |dlogprob|": diffs[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="continuation per prompt")
    parser.add_argument("--json", default="bench/results/gguf_agreement.json")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(resolve_model_dir(DEFAULT_MODEL, default_cache_dir()))
    starts = prompts(tokenizer)
    sequences = [s + c for s, c in zip(starts, continuations(starts, args.tokens), strict=True)]
    lengths = [len(s) for s in starts]
    reference = trio_positions(sequences, lengths, dtype="float32")
    rows = [summary("trio float32 (reference, itself)", reference, reference)]
    rows.append(summary("trio gguf (prefill)", reference, trio_positions(sequences, lengths)))
    two = trio_positions(sequences, lengths, max_num_batched_tokens=2)
    rows.append(summary("trio gguf (2 tokens a step)", reference, two))
    theirs = llama_cpp_positions(sequences, lengths)
    if theirs is not None:
        rows.append(summary("llama.cpp (llama-cpp-python)", reference, theirs))
    print(f"\nteacher-forced against trio_llm float32, {len(reference)} positions:")
    for row in rows:
        print(
            f"  {row['system']:32s} top-1 {row['top-1 agreement']:7.2%}  |dlogprob| mean "
            f"{row['mean |dlogprob|']:.4f}  p95 {row['p95 |dlogprob|']:.4f}  "
            f"max {row['max |dlogprob|']:.4f}"
        )
    write_json(args.json, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
