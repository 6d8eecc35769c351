"""Issue 42's target rows for bench/kernel_targets.py, each figure with its share of what
this CPU allows.

The limits, measured in the same run (`measure_limits`):

- memory bandwidth: GB/s of a sum over a 1 GiB float32 tensor on every torch thread (one
  read of every byte; the c=1 limit: a decode step reads every weight once and the
  request's keys and values);
- the products' peak: GFLOP/s of torch's bfloat16 ``linear`` at the model's shapes with
  1,024 rows (oneDNN, AMX where the CPU has it; `roofline.gemm_gflops`), the fastest
  product this CPU runs.

A c=1 figure's share: the bytes one decode step must read (`step_bytes`: the weights as
the system stores them, plus the KV cache at that context) per ITL, over the bandwidth.
A 32-client figure's share: the FLOPs its tokens cost (2 per weight for every prompt and
output token, the output projection for output tokens only: `roofline.tokens_per_second`'s
model) per second, over the peak.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import roofline
import torch

from trio_llm.model_files.named_models import default_gguf_path
from trio_llm.model_files.weight_headers import read_gguf_header

#: SmolLM2-135M: parameters a decode step reads (the tied embedding read once, as the
#: output projection), its layers and its KV heads of 64.
PARAMS = roofline.NON_EMBEDDING_PARAMS + roofline.LM_HEAD_PARAMS
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
#: Bytes of a weight and of a cached key or value element, per system.
WEIGHT_BYTES = {"trio-dequantized": 2, "trio-float32": 4, "vllm-cpu": 2}
KV_BYTES = {"trio-float32": 4}


def measure_limits() -> dict[str, float]:
    """This CPU's memory bandwidth (GB/s) and bfloat16 product peak (GFLOP/s)."""
    data = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    data.sum()
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        rates.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    del data
    return {
        "bandwidth_gb_s": statistics.median(rates),
        "peak_gflops": roofline.gemm_gflops(torch.bfloat16),
    }


def step_bytes(system: str, context: int) -> float:
    """Bytes one decode step of ``system`` reads at ``context`` tokens: its weights and its
    KV cache (GGUF systems: the file's tensors; others: 2 or 4 bytes a weight)."""
    if system in WEIGHT_BYTES:
        weights = PARAMS * WEIGHT_BYTES[system]
    else:
        weights = sum(tensor.nbytes for tensor in read_gguf_header(default_gguf_path()).tensors)
    kv = context * 2 * LAYERS * KV_HEADS * HEAD_DIM * KV_BYTES.get(system, 2)
    return weights + kv


def c1_share(system: str, context: int, itl_s: float, limits: dict[str, float]) -> float:
    """The share of the memory bandwidth a c=1 ITL of ``itl_s`` seconds uses."""
    return step_bytes(system, context) / itl_s / 1e9 / limits["bandwidth_gb_s"]


def clients_share(output_tok_s: float, args: Any, limits: dict[str, float]) -> float:
    """The share of the products' peak the 32-client run's tokens use."""
    per_output = (args.clients_input_len + args.clients_output_len) / args.clients_output_len
    total = output_tok_s * per_output
    flops = 2 * roofline.NON_EMBEDDING_PARAMS * total + 2 * roofline.LM_HEAD_PARAMS * output_tok_s
    return flops / 1e9 / limits["peak_gflops"]


def _median_ratio(ours: list[float], theirs: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def _verdict(ratio: float | None, goal: float, at_most: bool) -> str:
    if ratio is None:
        return "not run"
    return "met" if (ratio <= goal if at_most else ratio >= goal) else "missed"


class _Rows:
    def __init__(self, systems: list[str]) -> None:
        self.systems = systems
        self.rows: list[dict[str, Any]] = []

    def add(self, target: str, figures: dict[str, str], goal: float, ratio, at_most: bool):
        self.rows.append(
            {
                "target": target,
                **{name: figures.get(name, "") for name in self.systems},
                "goal": f"{'<=' if at_most else '>='} {goal:g}x",
                "ratio": "" if ratio is None else f"{ratio:.2f}",
                "result": _verdict(ratio, goal, at_most),
            }
        )


def _ratio(values: dict[str, float], ours: str, theirs: str) -> float | None:
    return values[ours] / values[theirs] if ours in values and theirs in values else None


def _clients_rows(rows: _Rows, report: dict[str, Any], args: Any, limits) -> None:
    clients = report.get("clients") or {}
    label = f"{args.clients} clients x (~{args.clients_input_len} -> {args.clients_output_len})"
    figures = {
        name: f"{value:.1f} tok/s ({clients_share(value, args, limits):.0%} of peak)"
        for name, value in clients.items()
    }
    for ours, theirs, goal in (
        ("trio", "vllm-cpu", 1.2),
        ("trio-float32", "vllm-cpu", 1.0),
        ("trio", "trio-dequantized", 1.0),
    ):
        target = f"{label}, {ours} / {theirs}"
        rows.add(target, figures, goal, _ratio(clients, ours, theirs), False)


def _c1_rows(rows: _Rows, report: dict[str, Any], args: Any, limits) -> None:
    c1 = report.get("c1") or {}
    for key, context in (("short", args.short_context), ("long", args.long_context)):
        figures = {}
        for name, values in c1.items():
            itl = statistics.median(values[f"itl_{key}_s"])
            share = c1_share(name, context, itl, limits)
            figures[name] = f"{itl * 1000:.1f} ms ({share:.0%} of bandwidth)"
        ratio = None
        if "trio" in c1 and "llama-cpp" in c1:
            ratio = _median_ratio(c1["trio"][f"itl_{key}_s"], c1["llama-cpp"][f"itl_{key}_s"])
        target = f"c=1 ITL at {context:,} tokens (median of {args.rounds}), trio / llama-cpp"
        rows.add(target, figures, 1.0, ratio, True)
    figures = {name: f"{statistics.median(v['ttft_long_s']):.2f} s" for name, v in c1.items()}
    ratio = None
    if "trio" in c1 and "vllm-cpu" in c1:
        ratio = _median_ratio(c1["trio"]["ttft_long_s"], c1["vllm-cpu"]["ttft_long_s"])
    rows.add(
        f"TTFT of a {args.long_context:,}-token prompt, trio / vllm-cpu", figures, 1.0, ratio, True
    )


def _hog_rows(rows: _Rows, report: dict[str, Any], args: Any, limits) -> None:
    hog = report.get("hog") or {}
    clients = hog.get("clients") or {}
    figures = {
        name: f"{value:.1f} tok/s (quiet {report.get('clients', {}).get(name, 0):.1f})"
        for name, value in clients.items()
    }
    target = f"beside a one-core busy loop: {args.clients} clients, trio / vllm-cpu"
    rows.add(target, figures, 1.0, _ratio(clients, "trio", "vllm-cpu"), False)
    itl = hog.get("itl_short_s")
    quiet = (report.get("c1") or {}).get("trio", {}).get("itl_short_s")
    ratio = statistics.median(itl) / statistics.median(quiet) if itl and quiet else None
    figures = {}
    if itl and quiet:
        figures["trio"] = (
            f"{statistics.median(itl) * 1000:.1f} ms (quiet {statistics.median(quiet) * 1000:.1f})"
        )
    target = f"beside a one-core busy loop: c=1 ITL at {args.short_context} tokens, trio / quiet"
    rows.add(target, figures, 1.3, ratio, True)


def target_rows(report: dict[str, Any], args: Any, systems: list[str]) -> list[dict[str, Any]]:
    """One row per target of issue 42: each system's figure with its share of this CPU's
    limit, the goal, the ratio it is judged by, met / missed / not run."""
    rows = _Rows(systems)
    limits = report.get("limits") or {"bandwidth_gb_s": float("nan"), "peak_gflops": float("nan")}
    _c1_rows(rows, report, args, limits)
    _clients_rows(rows, report, args, limits)
    _hog_rows(rows, report, args, limits)
    on_demand = report.get("on_demand")
    seconds = statistics.median(on_demand["first_token_s"]) if on_demand else None
    figures = {"trio": f"{seconds:.2f} s" if seconds is not None else ""}
    rows.add(
        "a model loaded on demand: its first token after the request (s; goal 3 s)",
        figures,
        1.0,
        None if seconds is None else seconds / 3.0,
        True,
    )
    for peer in ("llama-cpp", "vllm-cpu"):
        state = report["systems"].get(peer, "not chosen")
        rows.rows.append(
            {
                "target": f"make bench-peers gives a working {peer}",
                **{name: state if name == peer else "" for name in systems},
                "goal": "runs",
                "ratio": "",
                "result": "met"
                if state == "ran"
                else "not run"
                if state == "not chosen"
                else "missed",
            }
        )
    return rows.rows
