"""Cost of structured output in the engine: the median step time of 32 concurrent
requests when 0 %, 50 % and 100 % of them are constrained by a JSON Schema, the time
from adding a request with a new large schema to its first token, first use and cached,
the largest gap between tokens of unconstrained streams while requests with new large
schemas arrive (compiling a grammar must not stall the batch), and the time to fill 32
masks one after another or with llguidance's parallel fill.

    python bench/structured_output.py [--model M] [--requests 32] [--output-len 48]
        [--streams 8] [--arrivals 8] [--gaps-only | --masks-only]

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

import llguidance
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


def mask_fill_ms(core: EngineCore, properties: int, batch: int) -> dict[str, str]:
    """Per way of filling ``batch`` masks (llguidance's one by one; its parallel fill with
    an ``LLExecutor`` of 1 and 2 threads): the median, 90th percentile and sum (ms) over
    60 steps of ``batch`` matchers, each at another point of a valid document, every
    matcher advancing a token per step. The ways take turns within each step, each on
    its own copies of the matchers."""
    from trio_llm.structured_output.grammar_check import llguidance_numpy
    from trio_llm.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(core.info.model_dir)
    schema = json.loads(large_schema(properties, 0))
    values = {"string": "abc", "integer": 42, "boolean": True}
    document = {name: values[field["type"]] for name, field in schema["properties"].items()}
    tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False)
    spec = StructuredOutput("json", json.dumps(schema))
    start = []
    for i in range(batch):
        matcher = core.grammars.matcher(spec)
        assert matcher.consume_tokens(tokens[: i * len(tokens) // batch])
        start.append(matcher)
    llg_numpy = llguidance_numpy()
    executors = {n: llguidance.LLExecutor(n) for n in (1, 2)}

    def one_by_one(matchers: list, bitmask: object) -> None:
        for i, matcher in enumerate(matchers):
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, i)

    def parallel(threads: int):
        def fill(matchers: list, bitmask: object) -> None:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            llg_numpy.fill_next_token_bitmask_par(executors[threads], pairs, bitmask)

        return fill

    ways = {"one by one": one_by_one, "parallel, 1 thread": parallel(1)}
    ways["parallel, 2 threads"] = parallel(2)
    copies = {name: [m.deep_copy() for m in start] for name in ways}
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for step in range(60):
        order = order[1:] + order[:1]  # who goes first (and builds lazy state) rotates
        for name in order:
            bitmask = llg_numpy.allocate_token_bitmask(batch, core.runner.vocab_size)
            begin = time.perf_counter()
            ways[name](copies[name], bitmask)
            times[name].append(time.perf_counter() - begin)
        for matchers in copies.values():
            for i, matcher in enumerate(matchers):
                index = i * len(tokens) // batch + step
                if index < len(tokens) and not matcher.is_stopped():
                    assert matcher.consume_token(tokens[index])
    rows = {}
    for name, values_s in times.items():
        ordered = sorted(values_s)
        rows[name] = (
            f"median {statistics.median(ordered) * 1000:.2f}, "
            f"p90 {ordered[int(0.9 * len(ordered))] * 1000:.2f}, "
            f"sum {sum(ordered) * 1000:.0f}"
        )
    return rows


def token_gaps(
    core: EngineCore,
    prompt: list[int],
    streams: int,
    arrivals: list[str | None],
    length: int,
) -> tuple[float, float]:
    """``(median decode step, largest gap between tokens)`` in ms of ``streams``
    unconstrained streams while ``arrivals`` (one schema each; None: unconstrained) arrive
    at once, after the streams' fourth token.

    The gap is wall time between consecutive steps that give the streams a token, as the
    engine loop sees it (adding the arrivals between two steps included). The arrivals
    have 1-token prompts and stop after 16 tokens, so that their prefill barely moves a
    step: what is left is the cost of their grammars (and of a batch twice as large).
    """
    tag = f"gap-{time.monotonic()}"
    for i in range(streams):
        params = SamplingParams(max_tokens=length, temperature=1.0, seed=i, ignore_eos=True)
        assert core.add_request(AddRequest(f"{tag}-s{i}", prompt, params)) is None
    last: float | None = None
    gaps: list[float] = []
    steps: list[float] = []
    arrived = False
    while core.has_unfinished_requests():
        start = time.perf_counter()
        result = core.step()
        now = time.perf_counter()
        if result.stats.num_prefill_tokens == 0 and result.stats.num_scheduled_reqs:
            steps.append(now - start)
        stream = f"{tag}-s"
        if any(o.request_id.startswith(stream) and o.new_token_ids for o in result.outputs):
            if last is not None:
                gaps.append(now - last)
            last = now
        if not arrived and len(gaps) >= 3:
            arrived = True
            for i, schema in enumerate(arrivals):
                spec = None if schema is None else StructuredOutput("json", schema)
                params = SamplingParams(
                    max_tokens=16, temperature=1.0, seed=i, structured_output=spec
                )
                rejected = core.add_request(AddRequest(f"{tag}-a{i}", prompt[:1], params))
                assert rejected is None, rejected
    return round(statistics.median(steps) * 1000, 1), round(max(gaps) * 1000, 1)


def print_gaps(label: str, figures: list[tuple[float, float]]) -> None:
    """One line: medians over runs of the median step, the largest gap and their ratio
    (taken in each run, so that a slower run on a shared machine counts alike)."""
    step = statistics.median(f[0] for f in figures)
    gap = statistics.median(f[1] for f in figures)
    ratio = statistics.median(g / s for s, g in figures)
    runs = ", ".join(f"{s}/{g}" for s, g in figures)
    print(
        f"  {label}: median step {step:.1f} ms, largest gap {gap:.1f} ms, "
        f"{ratio:.2f}x the step (runs, step/gap ms: {runs})"
    )


def print_masks(core: EngineCore, args: argparse.Namespace) -> None:
    """Print `mask_fill_ms` for ``--requests`` matchers."""
    print(f"{args.requests} masks of a {args.properties}-property schema, ms per step:")
    for name, figures in mask_fill_ms(core, args.properties, args.requests).items():
        print(f"  {name}: {figures}")


def step_table(core: EngineCore, prompt: list[int], args: argparse.Namespace) -> None:
    """Print the median step at 0/50/100 % constrained, and first-token times."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--properties", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--arrivals", type=int, default=8)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--gaps-only", action="store_true", help="only the gaps between tokens")
    only.add_argument("--masks-only", action="store_true", help="only the mask fill times")
    args = parser.parse_args()
    core = EngineCore.from_config(engine_config(args.model, dtype=args.dtype))
    core.warm_up()  # as the engine process does before it says it is ready
    if args.masks_only:
        print_masks(core, args)
        return
    prompt = list(range(1000, 1064))
    salts = iter(range(1000, 10**6))

    def gap_run(constrained: bool) -> tuple[float, float]:
        schemas = [
            large_schema(args.properties, next(salts)) if constrained else None
            for _ in range(args.arrivals)
        ]
        return token_gaps(core, prompt, args.streams, schemas, args.output_len)

    # First, before llguidance's tokenizer is loaded (the first constrained requests).
    cold = gap_run(True)
    # Loads llguidance's tokenizer once (the first constrained request pays it otherwise).
    first_token_ms(core, prompt, json.dumps({"type": "integer"}))
    if not args.gaps_only:
        step_table(core, prompt, args)
        print_masks(core, args)
    gaps: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for constrained in (False, True):
            gaps[constrained].append(gap_run(constrained))
    print(
        f"{args.streams} unconstrained streams, {args.arrivals} requests arriving at once "
        f"(1-token prompts, 16 tokens):"
    )
    print_gaps("unconstrained arrivals", gaps[False])
    print_gaps(f"arrivals with new {args.properties}-property schemas", gaps[True])
    print_gaps("the same, the first constrained requests (tokenizer not loaded)", [cold])


if __name__ == "__main__":
    main()
