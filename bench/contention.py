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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table, write_json

HERE = Path(__file__).resolve().parent


def _throughput_command(args: argparse.Namespace, out: Path) -> list[str]:
    command = [
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


def measure(args: argparse.Namespace, setting: str = "default", label: str | None = None) -> dict:
    """Output tok/s alone, beside a one-core hog and as one of two engines, with the
    slowdowns (``args``: the workload fields of `main`'s parser)."""
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    alone = _run_engines(args, setting, 1, hog=False)[0]["output_tok_per_s"]
    hogged = _run_engines(args, setting, 1, hog=True)[0]["output_tok_per_s"]
    pair = [r["output_tok_per_s"] for r in _run_engines(args, setting, 2, hog=False)]
    return {
        "setting": label or setting,
        "alone tok/s": alone,
        "hog tok/s": hogged,
        "hog slowdown": alone / hogged,
        "fair hog slowdown": cores / max(1, cores - 1),
        "pair tok/s each": " / ".join(f"{p:.1f}" for p in pair),
        "pair slowdown": alone / min(pair),
        "fair pair slowdown": 2.0,
        "seconds": time.perf_counter() - started,
    }


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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
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
