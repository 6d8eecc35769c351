"""The concrete dtype of ``--dtype auto``: bfloat16 where it is native and faster, else
float32."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trio_llm.config import ModelConfig

logger = logging.getLogger(__name__)


#: CPU flags (``/proc/cpuinfo``) of native bf16 matrix arithmetic. Without them torch
#: emulates bf16 GEMMs, about 10x slower than float32 on an AVX2-only CPU (docs/benchmarks.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


#: bfloat16 must be this much faster than float32 at the model's shapes to be chosen.
BF16_MIN_SPEEDUP = 1.05


def bf16_speedup(hidden_size: int, intermediate_size: int, rows: int = 32) -> float:
    """float32 time / bfloat16 time of ``[rows, hidden] x [hidden, intermediate]`` and
    back (the decoder's MLP products), best of 5 after a warm-up; about 0.1 s on a CPU.

    Returns:
        Above 1 where bfloat16 is faster on this CPU.
    """
    import time

    import torch

    def best(dtype: torch.dtype) -> float:
        x = torch.randn(rows, hidden_size, dtype=dtype)
        up = torch.randn(intermediate_size, hidden_size, dtype=dtype)
        down = torch.randn(hidden_size, intermediate_size, dtype=dtype)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            torch.nn.functional.linear(torch.nn.functional.linear(x, up), down)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(torch.float32) / best(torch.bfloat16)


def resolve_dtype(
    dtype: str,
    device: str,
    flags: frozenset[str] | None = None,
    shapes: tuple[int, int] | None = None,
) -> str:
    """The concrete dtype for ``--dtype``: ``float32`` or ``bfloat16``.

    ``auto`` is bfloat16 on CUDA. On a CPU it is float32 unless its ``flags`` (default:
    this machine's) include native bf16 arithmetic (`NATIVE_BF16_CPU_FLAGS`): without it
    torch emulates bf16 products at about a tenth of the float32 speed. With it, and
    ``shapes`` = ``(hidden_size, intermediate_size)`` given, the products are timed in
    both dtypes (`bf16_speedup`) and bfloat16 is chosen only if at least
    `BF16_MIN_SPEEDUP` times faster (on an AVX-512-BF16 Xeon, bf16 serving ran 8-12 %
    slower than float32); without ``shapes``, bfloat16.
    """
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    if not flags & NATIVE_BF16_CPU_FLAGS:
        return "float32"
    if shapes is None:
        return "bfloat16"
    speedup = bf16_speedup(*shapes)
    choice = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
    logger.info(f"--dtype auto: bfloat16 products {speedup:.2f}x as fast as float32: {choice}")
    return choice


def dtype_is_timed(model: ModelConfig) -> bool:
    """Whether an engine resolves this model's ``--dtype`` by timing bfloat16 against
    float32 (`resolve_dtype`): ``auto`` on a CPU with native bf16 arithmetic. Two
    engines may then choose differently."""
    return (
        model.dtype == "auto"
        and model.device == "cpu"
        and bool(cpu_flags() & NATIVE_BF16_CPU_FLAGS)
    )
