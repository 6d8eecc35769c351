"""What this machine's matrix units allow for a model: measured GEMM rate -> tokens/s.

    python bench/roofline.py

Times torch fp32 matrix products at the model's projection shapes (hidden 576 -> 1536,
576 -> 576, 1536 -> 576, a 1024-token batch) with every core, and divides by the
2 x parameters FLOPs one token costs (one multiply-add per weight). Attention and the
embedding lookup are left out, so this is an upper bound for all tokens together
(prompt + output).
"""

from __future__ import annotations

import os
import time

import torch

#: SmolLM2-135M: parameters excluding the tied embedding, which a token does not multiply.
NON_EMBEDDING_PARAMS = 106_200_000
#: Its output projection (49,152 x 576), computed for sampled tokens only.
LM_HEAD_PARAMS = 28_311_552

SHAPES = [(1024, 576, 1536), (1024, 576, 576), (1024, 1536, 576)]


#: ``--dtype`` names -> torch dtypes (``auto`` is measured as float32).
DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}


def gemm_gflops(
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    repeats: int = 20,
    rows: int | None = None,
) -> float:
    """Measured GFLOP/s of ``x @ W^T`` at the model's shapes (all torch threads, or the GPU);
    ``rows``: the rows of ``x`` instead of `SHAPES`' 1,024 (a decode batch's size)."""
    flops = 0.0
    seconds = 0.0

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        for m, k, n in SHAPES:
            m = rows or m
            x = torch.randn(m, k, dtype=dtype, device=device)
            w = torch.randn(n, k, dtype=dtype, device=device)
            torch.nn.functional.linear(x, w)  # warm-up
            sync()
            start = time.perf_counter()
            for _ in range(repeats):
                torch.nn.functional.linear(x, w)
            sync()
            seconds += time.perf_counter() - start
            flops += 2.0 * m * k * n * repeats
    return flops / seconds / 1e9


def numpy_gemm_gflops(repeats: int = 20) -> float:
    """The same measurement with numpy's BLAS (OpenBLAS in numpy's wheel), float32."""
    import numpy as np

    flops = 0.0
    seconds = 0.0
    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        x = rng.random((m, k), dtype=np.float32)
        w_t = rng.random((k, n), dtype=np.float32)
        x @ w_t  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            x @ w_t
        seconds += time.perf_counter() - start
        flops += 2.0 * m * k * n * repeats
    return flops / seconds / 1e9


def tokens_per_second(gflops: float, prompt_tokens: int, output_tokens: int) -> float:
    """Tokens/s (prompt + output) the GEMM rate allows for a workload of this mix."""
    flops = 2 * NON_EMBEDDING_PARAMS * (prompt_tokens + output_tokens)
    flops += 2 * LM_HEAD_PARAMS * output_tokens
    return (prompt_tokens + output_tokens) / (flops / (gflops * 1e9))


def main() -> None:
    for name, rate in (("torch (MKL)", gemm_gflops()), ("numpy (OpenBLAS)", numpy_gemm_gflops())):
        ceiling = tokens_per_second(rate, 64 * 250, 64 * 128)
        print(
            f"{name}: fp32 GEMM {rate:.1f} GFLOP/s on {os.cpu_count()} CPUs -> roofline for "
            f"64 x (250 prompt + 128 output) tokens {ceiling:.0f} total tok/s, "
            f"{ceiling * 128 / 378:.0f} output tok/s"
        )


if __name__ == "__main__":
    main()
