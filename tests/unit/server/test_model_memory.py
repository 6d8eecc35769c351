"""Memory estimates from file headers (`trio_llm.server.model_memory`): a GGUF file's weights
counted without the gguf package's reader, a safetensors folder's, the KV cache and the
engine per engine, and what /proc/meminfo says is available."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from trio_llm.config import DEFAULT_KV_CACHE_MEMORY, PREFIX_CACHE_QUEUE_BYTES, engine_config
from trio_llm.model_files import dtype_choice
from trio_llm.model_files.weight_headers import read_gguf_header
from trio_llm.server.model_memory import (
    ENGINE_OVERHEAD,
    available_bytes,
    estimate,
    weight_bytes,
)


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_a_gguf_files_weights_are_counted_from_its_header(tmp_path: Path) -> None:
    """Every kind of metadata value is skipped (a vocabulary's string array too), and the
    tensors' dimensions multiplied, as the gguf package's reader counts them."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("a.u32", 7)
    writer.add_float32("a.f32", 0.5)
    writer.add_bool("a.bool", True)
    writer.add_string("a.string", "text")
    writer.add_array("a.strings", ["x", "yy", "zzz"])
    writer.add_array("a.ints", [1, 2, 3])
    writer.add_custom_alignment(64)
    writer.add_tensor("one", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("two", np.zeros((3,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    expected = sum(int(tensor.n_elements) for tensor in reader.tensors)
    assert expected == 35
    assert read_gguf_header(path).data_start == reader.data_offset  # aligned to 64
    assert weight_bytes(str(path), 4) == 4 * 35
    assert weight_bytes(str(path), 4, keep_gguf_blocks=True) == path.stat().st_size


def test_a_folders_estimate_has_weights_kv_cache_and_engines(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _safetensors(folder / "model.safetensors", {"a": [4, 8], "b": [16]})
    need = estimate(engine_config(str(folder), dtype="float32"), "hf", engines=2)
    assert need.weights == 2 * (32 + 16) * 4
    assert need.kv_cache == 2 * DEFAULT_KV_CACHE_MEMORY
    assert need.overhead == 2 * ENGINE_OVERHEAD
    embedding = estimate(engine_config(str(folder), dtype="bfloat16"), "sentence-transformers")
    assert embedding.weights == (32 + 16) * 2 and embedding.kv_cache == 0
    sized = estimate(engine_config(str(folder), dtype="float32", kv_cache_memory=2**20), "hf")
    assert sized.kv_cache == 2**20
    # The prefix cache's tier on disk holds its writer's queue in memory.
    tier = engine_config(str(folder), dtype="float32", prefix_cache_dir=str(tmp_path / "kv"))
    assert estimate(tier, "hf").kv_cache == DEFAULT_KV_CACHE_MEMORY + PREFIX_CACHE_QUEUE_BYTES


def test_auto_is_estimated_at_the_dtype_the_engine_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU with native bf16, ``--dtype auto`` loads a generating model in bfloat16 and
    an embedding model in float32 (`trio_llm.engine.pooling`)."""
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _safetensors(folder / "model.safetensors", {"a": [4, 8], "b": [16]})
    assert estimate(engine_config(str(folder)), "hf").weights == (32 + 16) * 2
    embedding = estimate(engine_config(str(folder)), "sentence-transformers")
    assert embedding.weights == (32 + 16) * 4


def test_available_memory_comes_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  512 kB\n")
    assert available_bytes(meminfo) == 512 * 1024
    assert available_bytes(tmp_path / "missing") is None
