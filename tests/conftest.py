"""Shared fixtures: the tiny random model, the real SmolLM2 folder, a running server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.tiny_model import save_tiny_model
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_loader import resolve_model_dir


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from GGUF once, cached)."""
    return resolve_model_dir(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (vocabulary 49,152), saved to disk."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-model"), tokenizer_dir=real_model_dir, vocab_size=49152
    )


@pytest.fixture(scope="session")
def smol_tokenizer(real_model_dir: Path):
    """The SmolLM2 tokenizer (byte-level BPE with a ChatML template)."""
    from trio_llm.text.tokenizer import Tokenizer

    return Tokenizer.load(real_model_dir)
