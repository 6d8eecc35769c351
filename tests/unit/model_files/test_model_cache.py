"""The converted-model cache is keyed by the GGUF file's content, not its path."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trio_llm.errors import ModelConversionError
from trio_llm.model_files.gguf_convert import _cache_key, convert_gguf


def _gguf(folder: Path, content: bytes) -> Path:
    folder.mkdir(parents=True)
    path = folder / "model.Q4_1.gguf"
    path.write_bytes(content)
    return path


def test_the_same_file_at_another_path_has_the_same_key(tmp_path: Path) -> None:
    first = _gguf(tmp_path / "venv-a", b"GGUF" + bytes(range(256)) * 64)
    second = tmp_path / "venv-b" / first.name
    second.parent.mkdir()
    shutil.copy(first, second)  # a new mtime and a new path, the same bytes
    assert _cache_key(first, tmp_path / "cache") == _cache_key(second, tmp_path / "cache")
    assert _cache_key(first, tmp_path / "cache").startswith("model.Q4_1-")


def test_different_content_has_a_different_key(tmp_path: Path) -> None:
    first = _gguf(tmp_path / "a", b"GGUF" + b"\x00" * 1024)
    second = _gguf(tmp_path / "b", b"GGUF" + b"\x00" * 1023 + b"\x01")
    assert _cache_key(first, tmp_path / "cache") != _cache_key(second, tmp_path / "cache")


def test_a_reinstalled_file_finds_the_conversion_already_made(tmp_path: Path) -> None:
    """A cached folder for these bytes is returned as is: nothing is converted (the fake
    file is not a loadable GGUF, so a conversion would fail)."""
    original = _gguf(tmp_path / "old-venv", b"GGUF not really a model")
    cached = tmp_path / "cache" / "models" / _cache_key(original, tmp_path / "cache" / "models")
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    reinstalled = _gguf(tmp_path / "new-venv", original.read_bytes())
    assert convert_gguf(reinstalled, tmp_path / "cache") == cached


@pytest.mark.slow  # spawns a process (for the id of one that has ended)
def test_a_killed_conversion_s_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    models = tmp_path / "cache" / "models"
    finished = subprocess.Popen(["true"])  # a process id that no longer runs
    finished.wait()
    dead_pid = finished.pid
    abandoned = models / f".convert-{dead_pid}-abc123"
    running = models / f".convert-{os.getpid()}-def456"  # a conversion still going on
    for folder in (abandoned, running):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"partial")
    gguf = _gguf(tmp_path / "venv", b"GGUF not really a model")
    with pytest.raises(ModelConversionError):
        convert_gguf(gguf, tmp_path / "cache")
    assert not abandoned.exists()
    assert running.exists()
    assert [p.name for p in models.iterdir() if p.name.startswith(".convert-")] == [running.name]


def test_a_corrupt_file_is_a_clear_error_and_caches_nothing(tmp_path: Path) -> None:
    gguf = _gguf(tmp_path / "venv", b"GGUF truncated")
    with pytest.raises(ModelConversionError) as caught:
        convert_gguf(gguf, tmp_path / "cache")
    assert str(gguf) in str(caught.value)
    left = [p.name for p in (tmp_path / "cache" / "models").iterdir()]
    assert left == [".digests"]  # no model folder, no partial conversion


def test_the_digest_is_hashed_once_per_file_version(tmp_path: Path) -> None:
    """The memo is what a second start reads (a planted digest shows it is consulted);
    rewriting the file (a new mtime) hashes it again."""
    models = tmp_path / "cache"
    gguf = _gguf(tmp_path / "venv", b"GGUF version 1")
    first = _cache_key(gguf, models)
    (memo,) = (models / ".digests").iterdir()
    memo.write_text("f" * 64)
    assert _cache_key(gguf, models) == "model.Q4_1-" + "f" * 12
    gguf.write_bytes(b"GGUF version 2")
    os.utime(gguf, ns=(gguf.stat().st_mtime_ns + 10**9,) * 2)
    second = _cache_key(gguf, models)
    assert second not in (first, "model.Q4_1-" + "f" * 12)
