"""The offline engine sharing the machine's cores: alone, beside a CPU hog, and two at once.

    python bench/contention.py [--num-prompts 32 --input-len 128 --output-len 32]

Each run is `bench/throughput.py` in its own process (its engine in a child of that),
on the same prompts:

- ``alone``: nothing else running;
- ``hog``: a process that spins on one core for the whole run (it takes one core of
  ``os.cpu_count()``; the fair slowdown is ``cores / (cores - 1)``, 2x on two cores);
- ``pair``: two engines started together, each on the same workload (the fair slowdown
  of each is 2x: they share every core).

``--num-threads auto`` runs the engines with `trio_llm.engine.cpu_share` on. Every run is
repeated with each ``--env`` setting (``default`` = the environment as
given), to compare OpenMP wait policies; the figure is output tok/s and its slowdown
against ``alone`` in the same setting.

``--policies`` compares thread policies instead, interleaved over ``--rounds`` rounds
(alone, then beside the hog, for each policy in turn; no pair): each policy is a
``--num-threads`` value (``default`` = the engine's default, ``auto``, ``N``), optionally
with ``@pin`` to run the whole offline process on the last cores only (``taskset``), one
core left free, as vLLM's CPU build leaves one to its API server. The table gives each
policy's median tok/s alone and beside the hog, its own slowdown, and its slowdown against
the first policy alone (what a user of that policy loses against the first one quiet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table, write_json

HERE = Path(__file__).resolve().parent


def _throughput_command(args: argparse.Namespace, out: Path) -> list[str]:
    command = [
        *getattr(args, "prefix", []),
        sys.executable, str(HERE / "throughput.py"),
        "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--dtype", args.dtype,
        "--json", str(out),
    ]  # fmt: skip
    if args.quantization:
        command += ["--quantization", args.quantization]
    if getattr(args, "num_threads", None):
        command += ["--num-threads", args.num_threads]
    return command


def _env(setting: str) -> dict[str, str]:
    env = dict(os.environ)
    if setting != "default":
        for pair in setting.split(","):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def _run_engines(args: argparse.Namespace, setting: str, count: int, hog: bool) -> list[dict]:
    """``count`` throughput runs started together (and a hog beside them if asked)."""
    folder = Path(tempfile.mkdtemp(prefix="trio-llm-contention-"))
    hog_process = None
    if hog:
        hog_process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        outs = [folder / f"run{i}.json" for i in range(count)]
        runs = [
            subprocess.Popen(
                _throughput_command(args, out),
                env=_env(setting),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for out in outs
        ]
        for run in runs:
            if run.wait() != 0:
                raise RuntimeError(f"throughput.py exited {run.returncode} ({setting})")
        return [json.loads(out.read_text()) for out in outs]
    finally:
        if hog_process is not None:
            hog_process.kill()
            hog_process.wait()


def measure(
    args: argparse.Namespace,
    setting: str = "default",
    label: str | None = None,
    pair: bool = True,
) -> dict:
    """Output tok/s alone, beside a one-core hog and (with ``pair``) as one of two engines,
    with the slowdowns (``args``: the workload fields of `main`'s parser)."""
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    alone = _run_engines(args, setting, 1, hog=False)[0]["output_tok_per_s"]
    hogged = _run_engines(args, setting, 1, hog=True)[0]["output_tok_per_s"]
    row = {
        "setting": label or setting,
        "alone tok/s": alone,
        "hog tok/s": hogged,
        "hog slowdown": alone / hogged,
        "fair hog slowdown": cores / max(1, cores - 1),
    }
    if pair:
        each = [r["output_tok_per_s"] for r in _run_engines(args, setting, 2, hog=False)]
        row["pair tok/s each"] = " / ".join(f"{p:.1f}" for p in each)
        row["pair slowdown"] = alone / min(each)
        row["fair pair slowdown"] = 2.0
    row["seconds"] = time.perf_counter() - started
    return row


def _policy_args(args: argparse.Namespace, policy: str) -> argparse.Namespace:
    threads, _, pin = policy.partition("@")
    prefix = []
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        prefix = ["taskset", "-c", ",".join(str(c) for c in cores[1:] or cores)]
    return argparse.Namespace(
        **{**vars(args), "num_threads": None if threads == "default" else threads},
        prefix=prefix,
    )


def measure_policies(args: argparse.Namespace, policies: list[str], rounds: int) -> list[dict]:
    """Each thread policy alone and beside a one-core hog, interleaved over ``rounds``
    rounds; per policy the median output tok/s and slowdowns (see the module docstring)."""
    alone: dict[str, list[float]] = {p: [] for p in policies}
    hogged: dict[str, list[float]] = {p: [] for p in policies}
    for round_ in range(rounds):
        for policy in policies:
            run_args = _policy_args(args, policy)
            alone[policy].append(_run_engines(run_args, "default", 1, False)[0]["output_tok_per_s"])
            hogged[policy].append(_run_engines(run_args, "default", 1, True)[0]["output_tok_per_s"])
            print(
                f"  round {round_ + 1} {policy}: alone {alone[policy][-1]:.1f} tok/s, "
                f"beside the hog {hogged[policy][-1]:.1f} tok/s",
                flush=True,
            )
    first = statistics.median(alone[policies[0]])
    rows = []
    for policy in policies:
        quiet, loaded = statistics.median(alone[policy]), statistics.median(hogged[policy])
        rows.append(
            {
                "policy": policy,
                "alone tok/s": quiet,
                "hog tok/s": loaded,
                "hog slowdown": quiet / loaded,
                f"hog vs {policies[0]} alone": first / loaded,
                f"alone vs {policies[0]} alone": first / quiet,
                "alone runs": " / ".join(f"{x:.1f}" for x in alone[policy]),
                "hog runs": " / ".join(f"{x:.1f}" for x in hogged[policy]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--num-threads", default=None, help="the engines' --num-threads (N or auto)"
    )
    parser.add_argument(
        "--env",
        nargs="+",
        default=["default"],
        help="settings to compare, e.g. default OMP_WAIT_POLICY=ACTIVE",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=None,
        help="thread policies to compare interleaved, e.g. default auto 1 1@pin",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --policies")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.policies:
        rows = measure_policies(args, args.policies, args.rounds)
        print()
        print_table(rows, list(rows[0]))
        write_json(args.json, {"cores": cores, "policies": rows})
        return
    rows = []
    for setting in args.env:
        threads = f", --num-threads {args.num_threads}" if args.num_threads else ""
        rows.append(measure(args, setting, f"{setting}{threads}"))
        print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    for row in rows:
        print(
            f"target 5 ({row['setting']}): beside a one-core hog {row['hog slowdown']:.2f}x "
            f"slower vs goal <= 2.2x; two engines {row['pair slowdown']:.2f}x slower each "
            f"vs goal <= 2.2x"
        )
    write_json(args.json, {"cores": cores, "rows": rows})


if __name__ == "__main__":
    main()
