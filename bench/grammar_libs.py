"""Constrained-decoding libraries on this machine (issue 17's choice): llguidance and
xgrammar, on SmolLM2's 49,152-token vocabulary.

    pip install llguidance xgrammar      # not dependencies of trio_llm (yet)
    python bench/grammar_libs.py

For each library that imports, prints: the time to make the tokenizer object (once per
model), to compile a JSON Schema of ``--properties`` properties (first use, and again
for the same schema), and the CPU time to compute the next-token mask while a valid
instance of that schema is decoded token by token, at batch 1 and batch 32 (32
matchers, each at another point of the document, masks filled for all of them each step;
each library's batch API where it has one). Figures are medians and maxima over the steps
(milliseconds).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir


def big_schema(properties: int) -> dict:
    """An object schema of ``properties`` required fields of mixed types."""
    kinds = [
        {"type": "string", "maxLength": 20},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def instance(properties: int) -> str:
    """A compact JSON document valid against `big_schema` (what is decoded)."""
    values = ["abc", 42, 3.5, True, "green", [1, 2]]
    return json.dumps(
        {f"field_{i}": values[i % len(values)] for i in range(properties)}, separators=(",", ":")
    )


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _figures(
    library: str, times: tuple[float, float, float], one: list[float], many: list[float], batch: int
) -> dict:
    """One library's row: its tokenizer's and two compiles' seconds (``times``), and the
    mask times of one matcher (``one``) and of ``batch`` matchers (``many``), in ms."""
    make_tokenizer, first_compile, second_compile = times
    return {
        "library": f"{library} {importlib.metadata.version(library)}",
        "tokenizer_ms": ms(make_tokenizer),
        "compile_first_ms": ms(first_compile),
        "compile_again_ms": ms(second_compile),
        "mask_b1_ms": ms(statistics.median(one)),
        "mask_b1_max_ms": ms(max(one)),
        f"mask_b{batch}_ms": ms(statistics.median(many)),
        f"mask_b{batch}_max_ms": ms(max(many)),
    }


def bench_llguidance(hf_tokenizer, schema: str, tokens: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    make_tokenizer = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    start = time.perf_counter()
    first = llguidance.LLMatcher(tokenizer, grammar)
    first_compile = time.perf_counter() - start
    assert not first.is_error(), first.get_error()
    start = time.perf_counter()
    llguidance.LLMatcher(tokenizer, grammar)
    second_compile = time.perf_counter() - start

    def run(n: int) -> list[float]:
        matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(n)]
        for i, matcher in enumerate(matchers):  # each one at another point of the document
            for token in tokens[:i]:
                assert matcher.consume_token(token), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(n, tokenizer.vocab_size)
        executor = llguidance.LLExecutor()
        times = []
        for step in range(len(tokens) - n):
            start = time.perf_counter()
            if n == 1:
                llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
            else:
                pairs = [(m, i) for i, m in enumerate(matchers)]
                llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask)
            times.append(time.perf_counter() - start)
            for i, matcher in enumerate(matchers):
                assert matcher.consume_token(tokens[step + i]), matcher.get_error()
        return times

    times = (make_tokenizer, first_compile, second_compile)
    return _figures("llguidance", times, run(1), run(batch), batch)


def bench_xgrammar(hf_tokenizer, schema: str, tokens: list[int], batch: int) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer)
    compiler = xgrammar.GrammarCompiler(info)
    make_tokenizer = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile_json_schema(schema)
    second_compile = time.perf_counter() - start

    def run(n: int) -> list[float]:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(n)]
        for i, matcher in enumerate(matchers):  # each one at another point of the document
            for token in tokens[:i]:
                assert matcher.accept_token(token)
        bitmask = xgrammar.allocate_token_bitmask(n, info.vocab_size)
        batch_matcher = xgrammar.BatchGrammarMatcher() if n > 1 else None
        times = []
        for step in range(len(tokens) - n):
            start = time.perf_counter()
            if batch_matcher is None:
                matchers[0].fill_next_token_bitmask(bitmask, 0)
            else:
                batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - start)
            for i, matcher in enumerate(matchers):
                assert matcher.accept_token(tokens[step + i])
        return times

    times = (make_tokenizer, first_compile, second_compile)
    return _figures("xgrammar", times, run(1), run(batch), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--properties", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    hf_tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model, default_cache_dir()))
    schema = json.dumps(big_schema(args.properties))
    tokens = hf_tokenizer.encode(instance(args.properties), add_special_tokens=False)
    print(
        f"{args.model}: vocabulary {len(hf_tokenizer)}, schema of {args.properties} properties "
        f"({len(schema)} bytes), instance of {len(tokens)} tokens"
    )
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            row = bench(hf_tokenizer, schema, tokens, args.batch)
        except ImportError as exc:
            print(f"{bench.__name__}: not installed ({exc})")
            continue
        print("  " + ", ".join(f"{key}: {value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
