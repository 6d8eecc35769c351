"""The concrete dtype of ``--dtype auto``, decided by what the hardware has: bfloat16 on
CUDA and on a CPU with native bf16 arithmetic, float32 on any other CPU; that of
``--kv-cache-dtype auto`` (`explain_kv_cache_dtype`): the model's, except on the GGUF path;
and the quantization of a model given none (`explain_quantization`): a GGUF file's own
blocks where the engine can multiply them.

The answer depends only on the CPU's flags, never on a timing, so every engine of one
model on one machine (data-parallel engines, restarted engines, two servers) serves the
same dtype and answers the same tokens. A timing of bfloat16 against float32 products at
the model's shapes (`bf16_speedup`) runs where bfloat16 was chosen on a CPU, and only
advises in the log (`log_dtype_choice`): under load it swings either way (1.87x and 0.80x
on one machine, issue 41).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


#: CPU flags (``/proc/cpuinfo``) of native bf16 matrix arithmetic. Without them torch
#: emulates bf16 GEMMs, about 10x slower than float32 on an AVX2-only CPU (docs/benchmarks.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

#: The CPU flag with which ``--kv-cache-dtype auto`` keeps a float32 GGUF-path model's
#: keys and values in bfloat16 (`explain_kv_cache_dtype`).
KV_BF16_CPU_FLAG = "avx512_bf16"

#: Below this bfloat16 / float32 speed ratio of the timing, the log suggests float32.
BF16_ADVICE_SPEEDUP = 1.0


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


def bf16_speedup(hidden_size: int, intermediate_size: int, rows: int = 32) -> float:
    """float32 time / bfloat16 time of ``[rows, hidden] x [hidden, intermediate]`` and
    back (the decoder's MLP products), best of 5 after a warm-up; about 0.1 s on a CPU.
    It depends on the machine's load: advice only, never the dtype (`log_dtype_choice`).

    Returns:
        Above 1 where bfloat16 is faster on this CPU now.
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


def explain_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """``(concrete dtype, why)`` for ``--dtype`` on ``device``.

    ``auto`` is bfloat16 on CUDA; on a CPU, bfloat16 where its ``flags`` (default: this
    machine's ``/proc/cpuinfo``) include one of `NATIVE_BF16_CPU_FLAGS`, else float32
    (torch would emulate bf16 products at about a tenth of the float32 speed). A dtype
    other than ``auto`` is kept. ``why`` names the flags found.
    """
    if dtype != "auto":
        return dtype, f"--dtype {dtype} given"
    if device == "cuda":
        return "bfloat16", "--dtype auto on CUDA"
    flags = cpu_flags() if flags is None else flags
    native = sorted(flags & NATIVE_BF16_CPU_FLAGS)
    if native:
        return "bfloat16", f"--dtype auto: the CPU has native bf16 ({', '.join(native)})"
    wanted = " or ".join(sorted(NATIVE_BF16_CPU_FLAGS))
    return "float32", f"--dtype auto: the CPU has no native bf16 (no {wanted} flag)"


def explain_kv_cache_dtype(
    kv_cache_dtype: str,
    model_dtype: str,
    quantization: str | None,
    flags: frozenset[str] | None = None,
) -> tuple[str, str]:
    """``(concrete KV cache dtype, why)`` for ``--kv-cache-dtype``.

    ``auto`` is ``model_dtype``, except for a float32 model with ``quantization="gguf"``
    on a CPU whose ``flags`` (default: this machine's ``/proc/cpuinfo``) include
    `KV_BF16_CPU_FLAG`: bfloat16 there. That path's outputs are already approximate (its
    products take int8 activations), and the cache is what bounds its concurrency, so
    half the bytes a block is twice the blocks. A plain float32 model keeps float32 keys
    and values: its greedy tokens stay those of transformers. A value other than ``auto``
    is kept.

    Args:
        kv_cache_dtype: one of `trio_llm.config.KV_CACHE_DTYPES`.
        model_dtype: the loaded model's dtype (``float32``, ``bfloat16``, ...).
        quantization: ``--quantization`` (``int8``, ``int4``, ``gguf``) or None.
        flags: the CPU's feature flags; None reads them (`cpu_flags`).

    Returns:
        The dtype's name (``float32``, ``bfloat16`` or ``float16``) and one phrase saying
        why, for the start-up log.
    """
    if kv_cache_dtype != "auto":
        return kv_cache_dtype, f"--kv-cache-dtype {kv_cache_dtype} given"
    if quantization != "gguf" or model_dtype != "float32":
        return model_dtype, "--kv-cache-dtype auto: the model's dtype"
    flags = cpu_flags() if flags is None else flags
    if KV_BF16_CPU_FLAG in flags:
        return "bfloat16", (
            f"--kv-cache-dtype auto: float32 model on the GGUF path, the CPU has {KV_BF16_CPU_FLAG}"
        )
    return model_dtype, (
        f"--kv-cache-dtype auto: the model's dtype (GGUF path, the CPU has no {KV_BF16_CPU_FLAG})"
    )


def explain_quantization(
    quantization: str | None,
    dtype: str,
    device: str,
    gguf_file: Path | None,
    gguf_problem: Callable[[Path], str | None],
) -> tuple[str | None, str]:
    """``(quantization method or None, why)`` for ``--quantization`` (None: not given).

    Not given, a GGUF file on the CPU is served from its own quantized blocks (``gguf``)
    unless ``dtype`` is ``float32`` (de-quantized float32 weights: the path whose greedy
    tokens are transformers') or ``gguf_problem(gguf_file)`` names why it cannot be (no
    native kernels, not a Llama file, a block type without a kernel); everything else is
    served de-quantized (None). ``none`` is None; another method is kept.

    Args:
        quantization: ``--quantization`` (`trio_llm.config.QUANTIZATION_METHODS`) or None.
        dtype: ``--dtype`` as given (``auto``, ``float32``, ``bfloat16``).
        device: ``cpu`` or ``cuda``.
        gguf_file: the model's GGUF file, None for a Hugging Face folder.
        gguf_problem: why a GGUF file cannot be served from its blocks, None if it can
            (`trio_llm.engine.gguf_linear.gguf_problem`).

    Returns:
        ``int8``, ``int4``, ``gguf`` or None, and one phrase for the start-up log.
    """
    if quantization is not None:
        method = None if quantization == "none" else quantization
        return method, f"--quantization {quantization} given"
    if gguf_file is None:
        return None, "--quantization auto: none (the model is not a GGUF file)"
    if device != "cpu":
        return None, "--quantization auto: none (GGUF blocks are multiplied on the CPU only)"
    if dtype == "float32":
        return None, "--quantization auto: none (--dtype float32 de-quantizes the GGUF weights)"
    problem = gguf_problem(gguf_file)
    if problem is not None:
        return None, f"--quantization auto: none, the GGUF weights de-quantized ({problem})"
    return "gguf", f"--quantization auto: gguf, the decoder multiplies {gguf_file.name}'s blocks"


@functools.cache
def _native_bf16_cpu() -> bool:
    return bool(cpu_flags() & NATIVE_BF16_CPU_FLAGS)


def context_dtype(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The dtype a prefill chunk attends to its cached context in
    (`trio_llm.engine.attention`): ``q_dtype``, except float32 queries over a bfloat16
    cache on a CPU with native bf16 (`NATIVE_BF16_CPU_FLAGS`): bfloat16 there. The keys
    and values are rounded to bfloat16 already; rounding the queries too lets torch's
    bf16 attention run, 3.1x as fast at 128 queries over 3,500 keys on an Intel Xeon with
    AMX (the float32 GGUF path's TTFT of a 7,000-token prompt: docs/benchmarks.md)."""
    import torch

    if (
        q_dtype == torch.float32
        and cache_dtype == torch.bfloat16
        and device.type == "cpu"
        and _native_bf16_cpu()
    ):
        return torch.bfloat16
    return q_dtype


def resolve_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The concrete dtype for ``--dtype``: ``float32`` or ``bfloat16`` (`explain_dtype`)."""
    return explain_dtype(dtype, device, flags)[0]


def log_dtype_choice(
    dtype: str,
    device: str,
    shapes: tuple[int, int] | None = None,
    *,
    flags: frozenset[str] | None = None,
    speedup: Callable[[int, int], float] = bf16_speedup,
) -> str:
    """`resolve_dtype`, logging why ``auto`` chose what it did. Where ``auto`` chose
    bfloat16 on a CPU and the model's ``shapes`` = ``(hidden_size, intermediate_size)``
    are known, also time both dtypes (``speedup``, default `bf16_speedup`) and log
    whether ``--dtype float32`` might serve faster. The timing never changes the answer.

    Returns:
        ``float32`` or ``bfloat16``.
    """
    choice, why = explain_dtype(dtype, device, flags)
    if dtype == "auto":
        logger.info(f"{why}: {choice}")
    if dtype == "auto" and device == "cpu" and choice == "bfloat16" and shapes is not None:
        ratio = speedup(*shapes)
        advice = "; --dtype float32 may serve faster here" if ratio < BF16_ADVICE_SPEEDUP else ""
        logger.info(
            f"--dtype auto: bfloat16 products timed {ratio:.2f}x as fast as float32 at "
            f"start-up (advice only, the dtype stays {choice}){advice}"
        )
    return choice
