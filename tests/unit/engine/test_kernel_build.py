"""The native kernels' build and load decisions (`trio_llm.engine.kernels`), without
compiling: a machine without a compiler, or whose compiler fails, runs the reference path
and says why; the cached library is per CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trio_llm.engine import attention, kernels


def test_without_a_compiler_the_reference_path_runs_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    status = kernels.load.__wrapped__(cache_dir=tmp_path)
    assert not status.loaded
    assert "no C++ compiler" in status.detail
    assert status.describe().startswith("attention: pure-torch reference path")
    assert kernels.library_path(tmp_path) is None
    # `auto` then attends on the reference path (nothing is built or loaded).
    monkeypatch.setattr(kernels, "load", lambda: status)
    assert attention.use_native_attention("auto", torch.device("cpu")) is False
    assert not any(tmp_path.iterdir())


def test_a_failing_compiler_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", "false")  # exists, exits 1
    status = kernels.load.__wrapped__(cache_dir=tmp_path)
    assert not status.loaded
    assert "building the native kernels failed" in status.detail
    with pytest.raises(RuntimeError, match="building the native kernels failed"):
        kernels.build(tmp_path)
    # No half-written library is left under the cached name.
    assert not list(tmp_path.rglob(kernels.LIBRARY_NAME))


def test_the_cached_library_is_per_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernels, "cpu_isa", lambda: ("avx2", "fma"))
    avx2 = kernels.library_path(tmp_path)
    monkeypatch.setattr(kernels, "cpu_isa", lambda: ("avx2", "fma", "avx512f", "avx512_bf16"))
    avx512 = kernels.library_path(tmp_path)
    assert avx2 is not None and avx512 is not None
    assert avx2 != avx512
    assert avx2.parent.parent == avx512.parent.parent == tmp_path / "kernels"


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRIO_LLM_NATIVE_KERNELS", "0")
    status = kernels.load.__wrapped__(cache_dir=tmp_path)
    assert not status.loaded
    assert "TRIO_LLM_NATIVE_KERNELS=0" in status.detail
