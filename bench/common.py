"""Shared benchmark pieces: sonnet prompts of a target token length, percentiles, tables,
scheduler gauges read from /metrics."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
# The repository root on sys.path, wherever a bench script is run from: this checkout's
# ``trio_llm`` and its test support (``tests.support``: server processes, /proc, SSE, chaos).
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))

from trio_llm.text.tokenizer import Tokenizer  # noqa: E402

# Benchmarks time computing: a server they start reads no prompt blocks an earlier run left
# on disk (bench/prefix_disk.py names its own folder).
os.environ.setdefault("TRIO_LLM_PREFIX_CACHE_DIR", "none")

SONNETS = ROOT / "data" / "sonnet.txt"


def sonnet_prompts(
    tokenizer: Tokenizer, num_prompts: int, prompt_len: int, seed: int = 0
) -> list[list[int]]:
    """``num_prompts`` token-id prompts of exactly ``prompt_len`` tokens each.

    Each prompt is a run of consecutive sonnet lines starting at a random line, cut to
    ``prompt_len`` tokens (the text wraps around the file). Token ids, not text, so every
    system sees exactly the same prompt length.
    """
    lines = [line for line in SONNETS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randrange(len(lines))
        ids: list[int] = []
        i = start
        while len(ids) < prompt_len:
            ids += tokenizer.encode(lines[i % len(lines)] + "\n", add_special_tokens=False)
            i += 1
        prompts.append(ids[:prompt_len])
    return prompts


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: list[float]) -> dict[str, float]:
    """mean, median and p99 of ``values`` (seconds stay seconds)."""
    return {
        "mean": statistics.fmean(values) if values else 0.0,
        "median": percentile(values, 50),
        "p99": percentile(values, 99),
    }


def rates(completed: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> dict:
    """``req_per_s``, ``output_tok_per_s`` and ``total_tok_per_s`` (prompt + output) of a
    run that completed ``completed`` requests in ``elapsed`` seconds, plus the counts."""
    return {
        "elapsed_s": elapsed,
        "req_per_s": completed / elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


#: The scheduler series of /metrics that the load benchmarks watch, and their values.
_SCHEDULER_SERIES = re.compile(
    r"^trio_llm:(num_requests_waiting|num_requests_running|kv_cache_usage_perc|num_preemptions)"
    r"\S*\s+(\S+)$"
)


@dataclass
class SchedulerMaxima:
    """The scheduler gauges seen over several /metrics scrapes (the latest preemption count)."""

    max_waiting: float = 0.0
    max_running: float = 0.0
    max_kv_usage: float = 0.0
    preemptions: float = 0.0

    def add_scrape(self, metrics_text: str) -> None:
        """Take one /metrics response body (Prometheus text format)."""
        values = {}
        for line in metrics_text.splitlines():
            match = _SCHEDULER_SERIES.match(line)
            if match:
                values[match.group(1)] = float(match.group(2))
        self.max_waiting = max(self.max_waiting, values.get("num_requests_waiting", 0))
        self.max_running = max(self.max_running, values.get("num_requests_running", 0))
        self.max_kv_usage = max(self.max_kv_usage, values.get("kv_cache_usage_perc", 0))
        self.preemptions = values.get("num_preemptions", self.preemptions)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain aligned text table."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (no-op when None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))


def parse_server_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line of a benchmark that starts its own server: ``parser``'s options
    and these: ``--pythonpath``, ``--json`` and the server's flags (after ``--``)."""
    parser.add_argument("--pythonpath", default=None, help="run the server from this checkout")
    parser.add_argument("--json", default=None)
    parser.add_argument("server_flags", nargs="*", help="flags for trio-llm serve (after --)")
    return parser.parse_args()


def server_env(args: argparse.Namespace) -> dict[str, str] | None:
    """The server's environment for ``--pythonpath`` (None: this checkout's)."""
    return {"PYTHONPATH": str(Path(args.pythonpath).resolve())} if args.pythonpath else None
