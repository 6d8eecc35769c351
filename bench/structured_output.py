"""Cost of structured output in the engine: the median step time of 32 concurrent
requests when 0 %, 50 % and 100 % of them are constrained by a JSON Schema, and the time
from adding a request with a new large schema to its first token, first use and cached.

    python bench/structured_output.py [--model M] [--requests 32] [--output-len 48]

Runs an `EngineCore` in this process (no server). All requests share one prompt and
decode ``--output-len`` tokens (EOS ignored; a constrained request that completes its
schema earlier stops then, so step times are compared over the first ``--output-len //
2`` decode steps, while every request is still running).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import print_table

from trio_llm.config import DEFAULT_MODEL, engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams, StructuredOutput

#: Long enough that no constrained request finishes inside the measured steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 40, "maxLength": 80},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}


def large_schema(properties: int, salt: int) -> str:
    """A new ``properties``-field schema (``salt`` makes its source, so its cache key, new)."""
    props = {
        f"f{salt}_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(properties)
    }
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def step_times(
    core: EngineCore, prompt: list[int], requests: int, share: float, length: int
) -> float:
    """Median decode step time (ms) with ``share`` of ``requests`` constrained."""
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    constrained = round(requests * share)
    for i in range(requests):
        params = SamplingParams(
            max_tokens=length,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            structured_output=spec if i < constrained else None,
        )
        assert core.add_request(AddRequest(f"{share}-{i}", prompt, params)) is None
    times = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        stats = core.step().stats
        elapsed = time.perf_counter() - start
        if stats.num_prefill_tokens == 0 and stats.num_running == requests:
            times.append(elapsed)
    return round(statistics.median(times[: length // 2]) * 1000, 1)


def first_token_ms(core: EngineCore, prompt: list[int], schema: str | None) -> float:
    """Time from adding one request constrained by ``schema`` (None: unconstrained) to its
    first token (ms)."""
    spec = None if schema is None else StructuredOutput("json", schema)
    params = SamplingParams(max_tokens=1, structured_output=spec)
    start = time.perf_counter()
    assert core.add_request(AddRequest(f"ttft-{time.monotonic()}", prompt, params)) is None
    while core.has_unfinished_requests():
        core.step()
    return round((time.perf_counter() - start) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--properties", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    core = EngineCore.from_config(engine_config(args.model, dtype=args.dtype))
    prompt = list(range(1000, 1064))
    # Loads llguidance's tokenizer once (the first constrained request pays it otherwise).
    first_token_ms(core, prompt, json.dumps({"type": "integer"}))
    shares = (0.0, 0.5, 1.0)
    runs: dict[float, list[float]] = {share: [] for share in shares}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        for share in shares:
            runs[share].append(step_times(core, prompt, args.requests, share, args.output_len))
    rows = [
        {
            "constrained": f"{int(share * 100)} %",
            "step_ms": statistics.median(runs[share]),
            "runs_ms": " ".join(map(str, runs[share])),
        }
        for share in shares
    ]
    base = rows[0]["step_ms"]
    for row in rows:
        row["vs_unconstrained"] = f"{row['step_ms'] / base:.2f}x"
    print(f"{args.model}: {args.requests} requests, median decode step")
    print_table(rows, list(rows[0]))
    plain = first_token_ms(core, prompt, None)
    new = first_token_ms(core, prompt, large_schema(args.properties, 1))
    cached = first_token_ms(core, prompt, large_schema(args.properties, 1))
    other = first_token_ms(core, prompt, large_schema(args.properties, 2))
    print(
        f"first token (64-token prompt): unconstrained {plain} ms; with a new "
        f"{args.properties}-property schema {new} ms; the same schema again {cached} ms; "
        f"another new one {other} ms"
    )


if __name__ == "__main__":
    main()
