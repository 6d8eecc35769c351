"""One choice's output processing: stop tokens, stop strings, logprobs alignment."""

from __future__ import annotations

import msgspec
import pytest

from trio_llm.messages import SamplingParams, TokenLogprobs
from trio_llm.text.choice import Choice
from trio_llm.text.token_delta import TokenDelta

EOS = 2


def _choice(tokenizer, params: SamplingParams, **options: object) -> Choice:
    prompt = tokenizer.encode("Numbers:", add_special_tokens=False)
    params = msgspec.structs.replace(params, **options)
    return Choice(0, tokenizer, prompt, params, frozenset({EOS}))


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -1.0, 1, [], [])


def _feed(choice: Choice, tokens: list[int], finish: str | None = None) -> list:
    """One engine delta per token (with logprobs); the last one carries ``finish``."""
    pieces = []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        delta = TokenDelta([token], finish if last else None, logprobs=[_lp(token)])
        pieces.append(choice.process(delta))
    return [p for p in pieces if p is not None]


def test_eos_text_is_left_out_and_stop_reason_is_none(smol_tokenizer) -> None:
    tokens = [*smol_tokenizer.encode(" one two", add_special_tokens=False), EOS]
    choice = _choice(smol_tokenizer, SamplingParams(), skip_special_tokens=False)
    pieces = _feed(choice, tokens, finish="stop")
    assert choice.text == " one two"
    assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == ("stop", None)
    assert choice.num_output_tokens == len(tokens)


def test_a_stop_on_a_content_token_keeps_its_text(smol_tokenizer) -> None:
    # A structured output whose grammar is complete stops on its last content token.
    tokens = smol_tokenizer.encode('{"a":1}', add_special_tokens=False)
    choice = _choice(smol_tokenizer, SamplingParams())
    pieces = _feed(choice, tokens, finish="stop")
    assert choice.text == '{"a":1}'
    assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == ("stop", None)
    assert [entry.token_id for piece in pieces for entry in piece.logprobs] == tokens


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_sets_stop_reason(smol_tokenizer, include: bool) -> None:
    tokens = smol_tokenizer.encode(" one two.", add_special_tokens=False)
    params = SamplingParams(stop_token_ids=(tokens[-1],))
    choice = _choice(smol_tokenizer, params, include_stop_str_in_output=include)
    pieces = _feed(choice, tokens, finish="stop")
    assert choice.text == (" one two." if include else " one two")
    assert pieces[-1].stop_reason == tokens[-1]


def test_a_stop_string_across_tokens_ends_the_choice(smol_tokenizer) -> None:
    tokens = smol_tokenizer.encode(" 1, 2, 3, 4, 5", add_special_tokens=False)
    choice = _choice(smol_tokenizer, SamplingParams(), stop=(", 3,",))
    pieces = _feed(choice, tokens)
    assert choice.text == " 1, 2"
    assert (choice.finish_reason, choice.stop_reason) == ("stop", ", 3,")
    assert choice.finished
    # Nothing after the stop is processed.
    assert choice.process(TokenDelta([tokens[0]])) is None
    # Every emitted piece carries the logprobs of exactly the tokens consumed so far.
    emitted = [lp.token_id for piece in pieces for lp in piece.logprobs]
    assert emitted == tokens[: len(emitted)]
    assert "".join(p.text for p in pieces) == choice.text


def test_held_back_text_is_flushed_when_generation_ends(smol_tokenizer) -> None:
    tokens = smol_tokenizer.encode(" 1, 2, 3", add_special_tokens=False)
    choice = _choice(smol_tokenizer, SamplingParams(), stop=(", 3, 4",))
    pieces = _feed(choice, tokens, finish="length")
    assert choice.text == " 1, 2, 3"
    assert pieces[-1].finish_reason == "length"
    assert [lp.token_id for p in pieces for lp in p.logprobs] == tokens


def test_stop_strings_wait_for_min_tokens(smol_tokenizer) -> None:
    tokens = smol_tokenizer.encode(" a, b, c, d", add_special_tokens=False)
    plain = _choice(smol_tokenizer, SamplingParams(), stop=(",",))
    _feed(plain, tokens)
    assert plain.text == " a"
    # min_tokens=4: the commas before the 4th token do not count; a later one stops it.
    choice = _choice(smol_tokenizer, SamplingParams(min_tokens=4), stop=(",",))
    _feed(choice, tokens)
    assert choice.stop_reason == ","
    assert choice.text.startswith(" a,")
    assert len(choice.text) > len(plain.text)


def test_a_stop_string_in_a_batch_of_tokens_ends_at_the_same_token(smol_tokenizer) -> None:
    """Tokens that arrive together (a slow consumer) stop exactly where single tokens do,
    so the text and the usage never depend on how the output was batched."""
    tokens = smol_tokenizer.encode(" 1, 2, 3, 4, 5", add_special_tokens=False)
    one_by_one = _choice(smol_tokenizer, SamplingParams(), stop=(", 3,",))
    _feed(one_by_one, tokens)
    batched = _choice(smol_tokenizer, SamplingParams(), stop=(", 3,",))
    piece = batched.process(TokenDelta(tokens, logprobs=[_lp(t) for t in tokens]))
    assert piece is not None and piece.finish_reason == "stop"
    assert batched.text == one_by_one.text == " 1, 2"
    assert batched.num_output_tokens == one_by_one.num_output_tokens < len(tokens)
    assert len(batched.all_logprobs) == len(one_by_one.all_logprobs)
