"""Chaos runner: N seeded trials of load + one fault each, then a summary table.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/chaos.py --trials 200 --seed 1

Each trial starts its own server (2 or 3 processes, engine restart on or off), loads it
with streaming and non-streaming HTTP requests, WebSocket generations and clients that
leave early, injects one fault at a random moment, and checks that every client got a
definite end, nothing was lost, no process or file descriptor was left behind, the port
is free and the exit status is the documented one (see tests/support/chaos.py and
docs/reliability.md). The table counts trials and failures per fault kind, hung clients,
orphans, lost requests and the median recovery time of restarted engines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import common  # noqa: F401  (puts the repository root on sys.path, for tests.support)
import trio

from tests.support.chaos import TrialResult, TrialSpec, plan_trials, run_trial
from tests.support.checks import become_subreaper
from tests.support.faults import FAULTS


def summary_table(results: list[TrialResult]) -> str:
    """A Markdown table: one row per fault kind, then the totals."""
    rows = defaultdict(list)
    for result in results:
        rows[result.spec.fault].append(result)
    lines = [
        "| fault | trials | failed | hung clients | orphans | lost requests "
        "| median recovery (s) | requests (complete / error / refused or cut) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, group: list[TrialResult]) -> str:
        recoveries = [r.recovery_seconds for r in group if r.recovery_seconds is not None]
        recovery = f"{statistics.median(recoveries):.1f}" if recoveries else "-"
        outcomes: dict[str, int] = defaultdict(int)
        for result in group:
            for outcome, count in result.outcomes.items():
                outcomes[outcome] += count
        other = sum(outcomes[k] for k in ("refused", "no-response", "cut"))
        return (
            f"| {name} | {len(group)} | {sum(not r.ok for r in group)} "
            f"| {sum(r.hung for r in group)} | {sum(r.orphans for r in group)} "
            f"| {sum(r.lost for r in group)} | {recovery} "
            f"| {outcomes['complete']} / {outcomes['error']} / {other} |"
        )

    for fault in FAULTS:
        if rows.get(fault):
            lines.append(row(fault, rows[fault]))
    lines.append(row("**all**", results))
    return "\n".join(lines)


async def run(args: argparse.Namespace, log_dir: Path, results: list[TrialResult]) -> None:
    """Run the planned trials (``--jobs`` at a time), appending each result as it ends."""
    faults = tuple(args.faults) if args.faults else FAULTS
    specs = plan_trials(args.trials, args.seed, faults, args.data_parallel_size)
    if args.only:
        specs = [spec for spec in specs if spec.index in args.only]
    print(f"{len(specs)} trials, seed {args.seed}, logs in {log_dir}", flush=True)
    slots = trio.Semaphore(args.jobs)

    async def one(spec: TrialSpec) -> None:
        async with slots:
            result = await run_trial(spec, log_dir)
        results.append(result)
        status = "ok  " if result.ok else "FAIL"
        print(f"{status} {spec.describe()} {result.seconds:.1f}s", flush=True)
        for failure in result.failures:
            print(f"       {failure}", flush=True)

    async with trio.open_nursery() as nursery:
        for spec in specs:
            nursery.start_soon(one, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    become_subreaper()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="trio-llm-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[TrialResult] = []
    started = time.monotonic()
    interrupted = False
    try:
        trio.run(run, args, log_dir, results)
    except KeyboardInterrupt:  # Ctrl-C: report the trials that finished
        interrupted = True
    results.sort(key=lambda r: r.spec.index)
    minutes = (time.monotonic() - started) / 60
    failed = sum(not r.ok for r in results)
    cut = f" (interrupted: {len(results)} of {args.trials})" if interrupted else ""
    print(f"\n{len(results)} trials in {minutes:.1f} min, {failed} failed{cut}\n")
    print(summary_table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"seed": args.seed, "trials": [r.as_dict() for r in results]}, indent=1)
        )
    return 1 if failed or interrupted else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=24, help="number of trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, help="only these fault kinds")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="trials run at once (each has its own server; 2 fits a 2-core machine)",
    )
    parser.add_argument(
        "--only",
        type=int,
        nargs="+",
        metavar="N",
        help="run only these trials of the plan (by number, e.g. to repeat a failure)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines per server: with 2, an engine fault fails one and the other serves on",
    )
    parser.add_argument("--log-dir", help="where server logs go (default: a temp folder)")
    parser.add_argument("--json", help="also write every trial's result to this file")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
