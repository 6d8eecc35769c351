"""Tokenizer fixtures shared by the detokenizer tests: byte-level and SentencePiece-style."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

SONNETS = Path(__file__).parents[2] / "bench" / "data" / "sonnet.txt"

#: The special tokens of a Llama-2-style vocabulary (the byte tokens are not special).
SENTENCEPIECE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def build_sentencepiece_style_tokenizer(vocab_size: int = 800) -> Tokenizer:
    """A Llama-2-style tokenizer: BPE over '▁'-joined text with byte fallback.

    Trained on the sonnets in ``bench/data``. The 256 ``<0xNN>`` byte tokens are ordinary
    vocabulary entries, as in Llama 2's ``tokenizer.json``: if they were special tokens,
    ``decode(..., skip_special_tokens=True)`` would silently drop every character that
    needed byte fallback (emoji, CJK) and the byte-fallback path would go untested.
    """
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SENTENCEPIECE_SPECIAL_TOKENS, *byte_tokens]
    )
    tokenizer.train_from_iterator(SONNETS.read_text().splitlines(), trainer)
    # The trainer registers all its special tokens as added (special) tokens; keep the
    # byte tokens in the model's vocabulary only.
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [
        token for token in data["added_tokens"] if token["content"] in SENTENCEPIECE_SPECIAL_TOKENS
    ]
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="session")
def byte_level(smol_tokenizer) -> Tokenizer:
    """SmolLM2's byte-level BPE (the ``tokenizers`` backend)."""
    return smol_tokenizer.backend


@pytest.fixture(scope="session")
def sentencepiece_style() -> Tokenizer:
    """See :func:`build_sentencepiece_style_tokenizer`."""
    return build_sentencepiece_style_tokenizer()


def stop_reference(
    text: str, stop: list[str], *, include_stop_str_in_output: bool = False
) -> tuple[str, str | None]:
    """Stop strings applied to a whole text by brute force: ``(output, matched stop)``.

    Scans every end index from the left; the first one at which the text ends with a
    stop string decides. If several stop strings end there, the longest wins.
    """
    stops = [s for s in stop if s]
    for end in range(len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            hit = max(hits, key=len)
            cut = end if include_stop_str_in_output else end - len(hit)
            return text[:cut], hit
    return text, None
