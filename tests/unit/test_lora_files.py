"""LoRA adapter folders read as untrusted input (`trio_llm.lora_files`), the server's
registry of served adapters (`trio_llm.frontend.lora_adapters`) and ``--lora-modules``.

Adapters are made by peft on a tiny Llama; broken ones are written by hand.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.lora import save_adapter
from tests.support.tiny_model import build_tiny_model, tiny_llama_config
from trio_llm.cli.types import parse_lora_module
from trio_llm.frontend.lora_adapters import LoraAdapters
from trio_llm.lora_files import AdapterError, module_shapes, read_adapter

BASE = tiny_llama_config().to_dict()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 adapter of every projection of the tiny Llama."""
    return save_adapter(build_tiny_model(), tmp_path_factory.mktemp("a") / "a", seed=1, rank=4)


def _copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "copy"))


def _edit_config(folder: Path, **changes: object) -> None:
    file = folder / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_a_peft_adapter_is_read_with_its_modules_rank_and_scaling(adapter: Path) -> None:
    files = read_adapter(adapter, BASE, max_rank=16)
    assert files.rank == 4 and files.scaling == pytest.approx(16 / 4)
    assert len(files.modules) == 2 * 7  # 2 layers x 7 projections
    assert {m.module for m in files.modules} == set(module_shapes(BASE)[1])
    assert read_adapter(adapter, BASE, max_rank=4).digest == files.digest


def test_rslora_scales_by_the_square_root(adapter: Path, tmp_path: Path) -> None:
    folder = _copy(adapter, tmp_path)
    _edit_config(folder, use_rslora=True)
    assert read_adapter(folder, BASE, 16).scaling == pytest.approx(16 / 2)


def test_the_digest_changes_with_the_weights(adapter: Path, tmp_path: Path) -> None:
    folder = _copy(adapter, tmp_path)
    before = read_adapter(folder, BASE, 16).digest
    _edit_config(folder, lora_alpha=3)
    assert read_adapter(folder, BASE, 16).digest != before


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"bias": "all"}, "biases"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"r": 0}, "positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha"),
    ],
)
def test_configs_the_engine_cannot_apply_are_refused(
    adapter: Path, tmp_path: Path, changes: dict, expected: str
) -> None:
    folder = _copy(adapter, tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=expected):
        read_adapter(folder, BASE, 16)


def test_a_rank_over_the_limit_is_refused(adapter: Path) -> None:
    with pytest.raises(AdapterError, match="rank 4 is over --max-lora-rank 2"):
        read_adapter(adapter, BASE, max_rank=2)


def test_an_adapter_of_another_base_model_is_refused(adapter: Path) -> None:
    other = BASE | {"hidden_size": 128}
    with pytest.raises(AdapterError, match="another base model"):
        read_adapter(adapter, other, 16)
    fewer_layers = BASE | {"num_hidden_layers": 1}
    with pytest.raises(AdapterError, match="the base model has 1 layers"):
        read_adapter(adapter, fewer_layers, 16)


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ({"base_model.model.lm_head.lora_A.weight": (4, 64)}, "not a module LoRA"),
        ({"base_model.model.model.embed_tokens.lora_embedding_A": (4, 512)}, "not a module"),
        ({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": (4, 64)}, "not a module"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 64)}, "both"),
        ({}, "holds no LoRA weights"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": "i8"}, "not floats"),
    ],
)
def test_tensors_the_engine_cannot_apply_are_refused(
    adapter: Path, tmp_path: Path, tensors: dict, expected: str
) -> None:
    folder = _copy(adapter, tmp_path)
    arrays = {
        key: np.zeros((4, 64), np.int8) if shape == "i8" else np.zeros(shape, np.float32)
        for key, shape in tensors.items()
    }
    save_file(arrays, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=expected):
        read_adapter(folder, BASE, 16)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\xff" * 64), "cannot be read"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b""), "cannot be read"),
        (lambda f: (f / "adapter_config.json").write_text("{"), "not JSON"),
        (lambda f: (f / "adapter_config.json").write_text("[1]"), "not a JSON object"),
        (lambda f: (f / "adapter_config.json").unlink(), "no readable adapter_config"),
        (lambda f: (f / "adapter_config.json").write_bytes(b" " * (2 << 20)), "over"),
        (lambda f: (f / "adapter_model.safetensors").rename(f / "adapter_model.bin"), "pickle"),
    ],
)
def test_malformed_files_are_refused(
    adapter: Path, tmp_path: Path, damage: object, expected: str
) -> None:
    folder = _copy(adapter, tmp_path)
    damage(folder)  # type: ignore[operator]
    with pytest.raises(AdapterError, match=expected):
        read_adapter(folder, BASE, 16)


@pytest.mark.parametrize("path", ["/nonexistent/adapter", "bad\0path", ""])
def test_a_missing_folder_is_refused(path: str) -> None:
    with pytest.raises(AdapterError):
        read_adapter(path, BASE, 16)


def _registry(tmp_path: Path, allowed: Path | None) -> LoraAdapters:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    return LoraAdapters(tmp_path, 16, allowed, reserved=("base",))


def test_the_registry_serves_names_and_forgets_them(adapter: Path, tmp_path: Path) -> None:
    adapters = _registry(tmp_path, None)
    ref = adapters.add("sql", str(adapter))
    assert adapters.get("sql") == ref and "sql" in adapters and ref.path == str(adapter)
    for name in ("sql", "base", ""):
        with pytest.raises(AdapterError) as caught:
            adapters.add(name, str(adapter))
        assert caught.value.param == "lora_name"
    assert adapters.remove("sql") == ref and adapters.get("sql") is None
    with pytest.raises(KeyError):
        adapters.remove("sql")


def test_runtime_loads_read_only_the_allowed_folder(adapter: Path, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = Path(shutil.copytree(adapter, allowed / "inside"))
    (allowed / "escape").symlink_to(adapter)  # a link out of the folder
    adapters = _registry(tmp_path, allowed)
    assert adapters.add("inside", str(inside), runtime=True).name == "inside"
    for path in (adapter, allowed / "escape", allowed / ".." / adapter.name):
        with pytest.raises(AdapterError, match="outside the folder"):
            adapters.add("other", str(path), runtime=True)
    assert adapters.add("static", str(adapter)).name == "static"  # --lora-modules: any
    with pytest.raises(AdapterError, match="--allowed-lora-dir"):
        _registry(tmp_path, None).add("x", str(inside), runtime=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=/a/b", ("sql", "/a/b")),
        ("sql = /a=b", ("sql", "/a=b")),
        ('{"name": "sql", "path": "/a", "base_model_name": "m"}', ("sql", "/a")),
    ],
)
def test_lora_modules_flags_parse_as_vllm_takes_them(text: str, expected: tuple) -> None:
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text", ["sql", "=/a", "sql=", "{", '{"name": "x"}', "[1]"])
def test_bad_lora_modules_flags_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)
