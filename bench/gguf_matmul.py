"""GGUF-native products (``--quantization gguf``) against the other weight paths.

Prints, interleaved in one run (so that other load on the machine hits every variant
alike), the median time of one product at SmolLM2-135M's shapes for M = 1 (batch-1
decode) and M = 32, for: the de-quantized float32 ``F.linear``, the ``--quantization
int8`` / ``int4`` kernels (`QuantizedLinear`), and `GGUFLinear` over the file's own
blocks; then the batch-1 decode step time of the engine with each, and with the GGUF
blocks but without the fused layer pieces (``gguf-unfused``).

    PYTHONPATH=. python bench/gguf_matmul.py [--threads 1] [--rounds 30] [--steps 30]
        [--no-engine] [--no-products]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch.nn import functional as F

from trio_llm.engine.gguf_linear import GGUFLinear, kernel_available
from trio_llm.engine.quantization import QuantizedLinear


def _shapes(reader) -> list[tuple[str, GGUFLinear]]:
    tensors = {t.name: t for t in reader.tensors}

    def linear(*names: str) -> GGUFLinear:
        parts = []
        for name in names:
            t = tensors[name]
            blocks = torch.from_numpy(np.array(t.data)).view(int(t.shape[1]), -1)
            parts.append(GGUFLinear(blocks, int(t.tensor_type), int(t.shape[0])))
        blocks = torch.cat([p.blocks for p in parts])
        return GGUFLinear(blocks, parts[0].ggml_type, parts[0].in_features)

    b = "blk.0."
    return [
        ("qkv 576->960", linear(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight")),
        ("o 576->576", linear(b + "attn_output.weight")),
        ("gate_up 576->3072", linear(b + "ffn_gate.weight", b + "ffn_up.weight")),
        ("down 1536->576", linear(b + "ffn_down.weight")),
        ("head 576->49152", linear("token_embd.weight")),
    ]


def _time_calls(fn, rounds: int, times: list[float]) -> None:
    """Append the time of each of ``rounds`` calls (µs)."""
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)


def products(rounds: int) -> None:
    from gguf import GGUFReader

    from trio_llm.model_files.named_models import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    print("| product | M | fp32 F.linear | int8 | int4 | gguf (file's blocks) | gguf vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for label, layer in _shapes(reader):
        weight = layer.dequantized()
        variants = {
            "fp32": lambda x, w=weight: F.linear(x, w),
            "int8": QuantizedLinear.from_weight(weight, None, "int8").forward,
            "int4": QuantizedLinear.from_weight(weight, None, "int4").forward,
            "gguf": layer.forward,
        }
        for m in (1, 32):
            x = torch.randn(m, layer.in_features)
            times: dict[str, list[float]] = {k: [] for k in variants}
            # Fewer calls of the output projection at M = 32 (0.1-0.2 s each).
            calls = max(2, rounds // 8) if m > 1 and layer.out_features > 10_000 else rounds
            for fn in variants.values():
                fn(x)  # warm up
            for _ in range(7):  # interleaved rounds
                for name, fn in variants.items():
                    _time_calls(lambda fn=fn, x=x: fn(x), calls, times[name])
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"| {label} | {m} | {med['fp32']:.0f} µs | {med['int8']:.0f} µs | "
                f"{med['int4']:.0f} µs | {med['gguf']:.0f} µs | {med['fp32'] / med['gguf']:.2f}x |"
            )


def decode_steps(steps: int) -> None:
    from trio_llm.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig
    from trio_llm.engine.core import EngineCore
    from trio_llm.messages import AddRequest, SamplingParams

    cores = {}
    for q in (None, "int8", "int4", "gguf", "gguf-unfused"):
        config = EngineConfig(
            model=ModelConfig(
                model=DEFAULT_MODEL,
                dtype="float32",
                quantization=q and q.removesuffix("-unfused"),
                max_model_len=1024,
            ),
            cache=CacheConfig(num_kv_blocks=128),
        )
        cores[q or "fp32"] = EngineCore.from_config(config)
    # The same GGUF blocks without the fused layer pieces (engine/native.py's unfused path).
    cores["gguf-unfused"].runner.native.fused = False
    prompt = list(range(1000, 1250))  # ~250 tokens
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for core in cores.values():
        core.add_request(AddRequest("r", prompt, params))
        core.step()  # the prefill
    times: dict[str, list[float]] = {k: [] for k in cores}
    for _ in range(steps):
        for name, core in cores.items():
            start = time.perf_counter()
            core.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    print("\n| batch-1 decode step (250-token prompt) | " + " | ".join(times) + " |")
    print("|---" * (len(times) + 1) + "|")
    med = [f"{statistics.median(v):.1f}" for v in times.values()]
    print(f"| median ms ({steps} steps, interleaved) | " + " | ".join(med) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-engine", action="store_true")
    parser.add_argument("--no-products", action="store_true")
    args = parser.parse_args()
    reason = kernel_available()
    if reason is not None:
        raise SystemExit(f"no GGUF kernels: {reason}")
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads}; per-call medians over 7 interleaved rounds")
    if not args.no_products:
        with torch.inference_mode():
            products(args.rounds)
    if not args.no_engine:
        decode_steps(args.steps)


if __name__ == "__main__":
    main()
