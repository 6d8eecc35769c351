"""Incremental detokenization on byte-level BPE (SmolLM2) and SentencePiece-style BPE."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from trio_llm.text.incremental import (
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)

OUTPUTS = [
    " Paris is the capital of France.",
    "Emoji: 🎉🚀 and 👩‍👩‍👧 family",
    " 東京は日本の首都です。中文也可以。",
    "  two leading spaces\nand a newline\n\n",
    "mixed: naïve café — “quotes” … ✓",
]


def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for start in range(0, len(output), chunk):
        piece = output[start : start + chunk]
        deltas.append(detok.add_tokens(piece, finished=start + chunk >= len(output)))
    assert "".join(deltas) == detok.text
    return deltas


def _expected(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str:
    """The output's text as decoded in the context of the prompt's tail."""
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    before = tokenizer.decode(context, skip_special_tokens=True)
    whole = tokenizer.decode(context + output, skip_special_tokens=True)
    assert whole.startswith(before)
    return whole[len(before) :]


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece_style"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", OUTPUTS)
def test_deltas_concatenate_to_the_one_shot_decode(
    request: pytest.FixtureRequest, family: str, chunk: int, text: str
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(family)
    prompt = tokenizer.encode("Question: say something.", add_special_tokens=False).ids
    output = tokenizer.encode(text, add_special_tokens=False).ids
    if family == "sentencepiece_style":
        output = output[1:] if tokenizer.id_to_token(output[0]) == "▁" else output
    deltas = _stream(tokenizer, prompt, output, chunk)
    expected = _expected(tokenizer, prompt, output)
    assert "".join(deltas) == expected
    assert REPLACEMENT_CHAR not in expected
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_split_characters_are_held_back_until_complete(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(byte_level, [])
    partial = [detok.add_tokens([token]) for token in ids[:-1]]
    assert partial == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "🎉"


def test_the_first_token_keeps_its_leading_space(sentencepiece_style: Tokenizer) -> None:
    prompt = sentencepiece_style.encode("Shall I compare thee", add_special_tokens=False).ids
    output = sentencepiece_style.encode("Shall I compare thee to", add_special_tokens=False).ids
    output = output[len(prompt) :]
    text = IncrementalDetokenizer(sentencepiece_style, prompt).add_tokens(output, finished=True)
    assert text == " to"


def test_an_incomplete_character_at_the_end_is_flushed(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ok 🎉", add_special_tokens=False).ids[:-1]
    detok = IncrementalDetokenizer(byte_level, [])
    text = detok.add_tokens(ids) + detok.add_tokens([], finished=True)
    assert text == byte_level.decode(ids)
    assert text.endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped(byte_level: Tokenizer) -> None:
    ids = [*byte_level.encode("Done.", add_special_tokens=False).ids, 2]  # 2 is <|im_end|>
    assert IncrementalDetokenizer(byte_level, []).add_tokens(ids, finished=True) == "Done."


def test_a_prompt_ending_mid_character_loses_no_output(sentencepiece_style: Tokenizer) -> None:
    """Token-id prompts can end inside a byte-fallback character; the output completes it."""
    byte = sentencepiece_style.token_to_id
    prompt = [byte("<0xE6>"), byte("<0x9D>")]  # the first two bytes of 東 (E6 9D B1)
    letters = sentencepiece_style.encode("aba", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(sentencepiece_style, prompt)
    deltas = [detok.add_tokens([byte("<0xB1>")])]
    deltas += [detok.add_tokens([t], finished=i == len(letters) - 1) for i, t in enumerate(letters)]
    assert "".join(deltas).endswith("aba")
    assert REPLACEMENT_CHAR not in "".join(deltas)
