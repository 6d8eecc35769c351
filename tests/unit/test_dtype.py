"""`--dtype auto`: bfloat16 only where the hardware does bf16 arithmetic natively."""

from __future__ import annotations

import pytest

from trio_llm.config import ModelConfig
from trio_llm.model_loader import resolve_dtype

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})


@pytest.mark.parametrize(
    ("dtype", "device", "flags", "expected"),
    [
        ("auto", "cpu", AVX2_ONLY, "float32"),
        ("auto", "cpu", AVX2_ONLY | {"avx512f", "avx512_bf16"}, "bfloat16"),
        ("auto", "cpu", AVX2_ONLY | {"amx_tile", "amx_bf16"}, "bfloat16"),
        ("auto", "cpu", AVX2_ONLY | {"avx512f", "avx512_vnni"}, "float32"),
        ("auto", "cuda", AVX2_ONLY, "bfloat16"),
        ("float32", "cuda", AVX2_ONLY, "float32"),
        ("bfloat16", "cpu", AVX2_ONLY, "bfloat16"),
    ],
)
def test_auto_dtype_follows_the_hardware(
    dtype: str, device: str, flags: frozenset[str], expected: str
) -> None:
    assert resolve_dtype(dtype, device, flags) == expected


def test_unknown_devices_are_rejected() -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        ModelConfig(device="tpu")
