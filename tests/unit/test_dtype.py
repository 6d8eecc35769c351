"""`--dtype auto`: bfloat16 only where the hardware does bf16 arithmetic natively."""

from __future__ import annotations

import pytest

from trio_llm import dtype_choice
from trio_llm.config import EngineConfig, ModelConfig
from trio_llm.dtype_choice import resolve_dtype

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


@pytest.mark.parametrize(
    ("speedup", "expected"), [(0.1, "float32"), (1.0, "float32"), (1.3, "bfloat16")]
)
def test_native_bf16_is_chosen_by_timing_at_the_model_shapes(
    speedup: float, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the model's shapes, a CPU with native bf16 gets bf16 only where its products
    time faster than float32's."""
    timed = []
    monkeypatch.setattr(
        dtype_choice, "bf16_speedup", lambda *shapes: timed.append(shapes) or speedup
    )
    native = AVX2_ONLY | {"avx512f", "avx512_bf16"}
    assert resolve_dtype("auto", "cpu", native, shapes=(576, 1536)) == expected
    assert timed == [(576, 1536)]
    # Without native bf16 no timing: float32.
    assert resolve_dtype("auto", "cpu", AVX2_ONLY, shapes=(576, 1536)) == "float32"
    assert len(timed) == 1


def test_bf16_speedup_times_both_dtypes() -> None:
    assert 0 < dtype_choice.bf16_speedup(64, 128, rows=4) < 1000


def test_unknown_devices_are_rejected() -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        ModelConfig(device="tpu")


@pytest.mark.parametrize(
    ("dtype", "device", "flags", "timed"),
    [
        ("auto", "cpu", AVX2_ONLY | {"avx512_bf16"}, True),
        ("auto", "cpu", AVX2_ONLY, False),  # float32 by the flags alone
        ("auto", "cuda", AVX2_ONLY | {"avx512_bf16"}, False),  # bfloat16 on a GPU
        ("float32", "cpu", AVX2_ONLY | {"avx512_bf16"}, False),
    ],
)
def test_dtype_is_timed_only_for_auto_on_a_cpu_with_native_bf16(
    dtype: str, device: str, flags: frozenset[str], timed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    assert dtype_choice.dtype_is_timed(ModelConfig(dtype=dtype, device=device)) is timed


def test_an_engine_config_keeps_the_dtype_auto_resolved_to() -> None:
    """What a first engine chose for auto is what its restarts and siblings load; a dtype
    the user gave is never replaced."""
    auto = EngineConfig(model=ModelConfig(dtype="auto"))
    assert auto.with_dtype("bfloat16").model.dtype == "bfloat16"
    assert auto.with_dtype("float32").model.dtype == "float32"
    assert auto.with_dtype("auto") is auto
    assert auto.with_dtype("float16") is auto  # not one --dtype takes
    given = EngineConfig(model=ModelConfig(dtype="float32"))
    assert given.with_dtype("bfloat16") is given
