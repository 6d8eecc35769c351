"""Property tests: IncrementalDetokenizer (+ StopMatcher) on random token streams.

Two tokenizer families: SmolLM2's byte-level BPE and a SentencePiece-style BPE with byte
fallback (see ``tests/unit/conftest.py``). Token ids come either straight from the
vocabulary (anything a model could sample, including special tokens and broken UTF-8)
or from encoding random text (so the text is valid). They are streamed in random chunks.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders

from tests.unit.conftest import stop_reference
from trio_llm.text.incremental import (
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)
from trio_llm.text.stop import StopMatcher

PROPERTY_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None)

#: Mostly characters that stress the detokenizer: spaces (SentencePiece's '▁'),
#: newlines, multi-byte UTF-8 (byte-level token splits, byte fallback), ZWJ sequences.
CHARS = st.one_of(
    st.sampled_from(list(" \n\tabcxyzTHE.,!é東京🎉🚀\u200d👩ß")),
    st.characters(codec="utf-8"),
)
texts = st.text(alphabet=CHARS, max_size=24)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece_style"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _random_ids(tokenizer: Tokenizer, max_size: int) -> st.SearchStrategy[list[int]]:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return st.lists(st.integers(0, vocab - 1), max_size=max_size)


def _text_ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Ids of random text; sometimes without a leading '▁' token (a mid-sentence chunk)."""

    def encode(args: tuple[str, bool]) -> list[int]:
        text, strip_leading_space = args
        ids = _encode(tokenizer, text)
        if strip_leading_space and ids and tokenizer.id_to_token(ids[0]) == "▁":
            ids = ids[1:]
        return ids

    return st.tuples(texts, st.booleans()).map(encode)


@st.composite
def _chunks(draw: st.DrawFn, ids: list[int]) -> list[list[int]]:
    """``ids`` cut at random points; the last chunk may be empty (finish on its own)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in pairwise(bounds)]


@st.composite
def _stops(draw: st.DrawFn, text: str) -> list[str]:
    """Up to three stop strings, mostly substrings of ``text`` so that they hit."""
    pieces = [st.text(alphabet=CHARS, min_size=1, max_size=3)]
    if text:
        pieces.append(
            st.integers(0, len(text) - 1).flatmap(
                lambda i: st.integers(i + 1, min(len(text), i + 6)).map(lambda j: text[i:j])
            )
        )
    return draw(st.lists(st.one_of(*pieces), max_size=3))


def _one_shot(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str | None:
    """The output's text decoded in one go after the prompt's tail (the detokenizer's
    context), or None when decoding the output changes the decoded prompt text."""
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    before = tokenizer.decode(context, skip_special_tokens=True)
    whole = tokenizer.decode(context + output, skip_special_tokens=True)
    return whole[len(before) :] if whole.startswith(before) else None


def _stream(tokenizer: Tokenizer, prompt: list[int], chunks: list[list[int]]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [
        detok.add_tokens(chunk, finished=index == len(chunks) - 1)
        for index, chunk in enumerate(chunks)
    ]
    assert "".join(deltas) == detok.text
    return deltas


def _check_stops(deltas: list[str], text: str, stops: list[str], include: bool) -> None:
    matcher = StopMatcher(stops, include_stop_str_in_output=include)
    out = "".join(
        matcher.feed(delta, finished=index == len(deltas) - 1) for index, delta in enumerate(deltas)
    )
    expected, expected_stop = stop_reference(text, stops, include_stop_str_in_output=include)
    assert out == expected
    assert matcher.stop_string == expected_stop
    event("stop string hit" if expected_stop is not None else "no stop string hit")


@PROPERTY_SETTINGS
@given(prompt_text=texts, include=st.booleans(), data=st.data())
def test_valid_text_streams_exactly(
    tokenizer: Tokenizer, prompt_text: str, include: bool, data: st.DataObject
) -> None:
    """Output ids of real text: deltas rebuild the one-shot decode, never show U+FFFD
    unless it decodes to one, and stop strings cut it exactly as on the whole text."""
    prompt = _encode(tokenizer, prompt_text)
    output = data.draw(_text_ids(tokenizer), label="output")
    chunks = data.draw(_chunks(output), label="chunks")

    deltas = _stream(tokenizer, prompt, chunks)
    expected = _one_shot(tokenizer, prompt, output)
    assert expected is not None
    assert "".join(deltas) == expected
    if REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)

    stops = data.draw(_stops(expected), label="stops")
    _check_stops(deltas, expected, stops, include)


@PROPERTY_SETTINGS
@given(prompt_text=texts, include=st.booleans(), data=st.data())
def test_random_token_ids_stream_exactly(
    tokenizer: Tokenizer, prompt_text: str, include: bool, data: st.DataObject
) -> None:
    """Any ids a model might sample, including special tokens and broken UTF-8.

    Byte-level decoding is prefix-stable once a character is complete, so the deltas
    always rebuild the one-shot decode. SentencePiece byte fallback is not: a run of
    ``<0xNN>`` tokens is decoded as a whole, so a stray byte after a complete character
    turns that character into U+FFFDs in the one-shot decode, after it was streamed.
    For that family the exact property is checked whenever the one-shot decode is clean.
    """
    prompt = _encode(tokenizer, prompt_text)
    output = data.draw(_random_ids(tokenizer, max_size=24), label="output")
    chunks = data.draw(_chunks(output), label="chunks")

    deltas = _stream(tokenizer, prompt, chunks)
    streamed = "".join(deltas)
    expected = _one_shot(tokenizer, prompt, output)
    prefix_stable = isinstance(tokenizer.decoder, decoders.ByteLevel)
    if prefix_stable or (expected is not None and REPLACEMENT_CHAR not in expected):
        assert streamed == expected
        event("deltas compared with the one-shot decode")
    if expected is not None and REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)

    stops = data.draw(_stops(streamed), label="stops")
    _check_stops(deltas, streamed, stops, include)
