"""A tiny random-weight Llama of the real architecture, for fast tests.

Same model class and code path as SmolLM2 (``LlamaForCausalLM``, grouped-query attention,
tied embeddings), only small: 2 layers, hidden size 64, 4 query heads over 2 KV heads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


#: The tiny shape, shared with `tests.support.architectures`: 2 layers, hidden size 64,
#: 4 query heads over 2 KV heads, and SmolLM2's bos and eos token ids.
TINY_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_llama_config(vocab_size: int = 512, max_position_embeddings: int = 512) -> LlamaConfig:
    """Config of the tiny model; ``eos_token_id`` is 2 as in SmolLM2."""
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        **TINY_SHAPE,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=2,
        initializer_range=0.5,
    )


def build_tiny_model(
    seed: int = 0, vocab_size: int = 512, max_position_embeddings: int = 512
) -> LlamaForCausalLM:
    """A float32 tiny Llama with weights drawn from ``seed`` (eval mode)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size, max_position_embeddings))
    model.eval()
    return model


def save_tiny_model(
    path: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, vocab_size: int = 512
) -> Path:
    """Write a tiny model folder (safetensors + config) loadable by ``from_pretrained``.

    Args:
        tokenizer_dir: copy the tokenizer files from here (``vocab_size`` should then
            match the tokenizer's vocabulary).
    """
    model = build_tiny_model(seed, vocab_size)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / name
            if source.exists():
                shutil.copy(source, Path(path) / name)
    return Path(path)


def save_tiny_cross_encoder(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random BERT cross-encoder (``BertForSequenceClassification``, one
    label, two segment types) with ``tokenizer_dir``'s WordPiece tokenizer: the folder
    sentence-transformers' ``CrossEncoder`` and the server both load. Its weights are
    drawn wide (``initializer_range`` 0.5) so that pairs get clearly different scores."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        type_vocab_size=2,
        num_labels=1,
        initializer_range=0.5,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(Path(tokenizer_dir) / name, Path(path) / name)
    return Path(path)
