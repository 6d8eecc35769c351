"""Stop strings and stop token ids, streamed and not, derived from a greedy baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, openai_client, parallel, token_id
from tests.support.server_process import ServerProcess

PROMPT = "The capital of France is"
MAX_TOKENS = 12


@dataclass
class Baseline:
    text: str
    tokens: list[str]


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> Baseline:
    """The greedy completion of PROMPT, with its tokens (it must run to the limit)."""
    with openai_client(server.url) as openai:
        reply = openai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == choice.text
    return Baseline(choice.text, choice.logprobs.tokens)


@dataclass
class Spanning:
    """A stop string made of the last two characters of output token ``index - 1`` and the
    first of token ``index``, first found right there (at offset ``cut``); and ``earlier``,
    the last three characters of token ``index - 1``, which ends one character before it."""

    stop: str
    cut: int
    index: int
    earlier: str


def spanning_stop(baseline: Baseline) -> Spanning:
    offset = 0
    for index in range(1, len(baseline.tokens)):
        left, right = baseline.tokens[index - 1], baseline.tokens[index]
        offset += len(left)
        if len(left) >= 3 and right.strip() and left.isascii() and right.isascii():
            stop, earlier = left[-2:] + right[0], left[-3:]
            cut = offset - 2
            if baseline.text.find(stop) == cut > 0 and baseline.text.find(earlier) == cut - 1:
                return Spanning(stop, cut, index, earlier)
    raise AssertionError(f"no usable stop string in {baseline.tokens}")


def _complete(client: OpenAI, **kwargs: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


def _streamed(client: OpenAI, **kwargs: Any) -> tuple[list[str], Any]:
    """The texts of a streamed completion's chunks and its last choice chunk."""
    chunks = [c for c in _complete(client, stream=True, **kwargs) if c.choices]
    return [c.choices[0].text for c in chunks], chunks[-1].choices[0]


def test_a_stop_string_spanning_two_tokens_cuts_the_text_before_it(
    client: OpenAI, baseline: Baseline
) -> None:
    span = spanning_stop(baseline)
    stop, cut = span.stop, span.cut
    never = baseline.text[-2:] + "#zq"  # its start ends the output: held back, then sent
    assert never not in baseline.text
    whole, (pieces, last), included, first_to_end, (never_pieces, never_last) = parallel(
        lambda: _complete(client, stop=[stop]),
        lambda: _streamed(client, stop=stop),
        lambda: _complete(client, stop=stop, extra_body={"include_stop_str_in_output": True}),
        lambda: _complete(client, stop=[stop, span.earlier]),
        lambda: _streamed(client, stop=[never]),
    )
    choice = whole.choices[0]
    assert choice.text == baseline.text[:cut]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop
    # Generation ends with the token that completes the stop string.
    assert whole.usage.completion_tokens == span.index + 1

    # Text held back as a possible start of the stop string is never sent, then dropped.
    assert "".join(pieces) == choice.text
    assert last.finish_reason == "stop"
    assert last.stop_reason == stop

    assert included.choices[0].text == baseline.text[: cut + len(stop)]
    assert included.choices[0].finish_reason == "stop"
    assert included.choices[0].stop_reason == stop

    # Of two stop strings, the one whose occurrence ends first wins (not the first listed).
    assert first_to_end.choices[0].text == baseline.text[: cut - 1]
    assert first_to_end.choices[0].stop_reason == span.earlier
    assert first_to_end.usage.completion_tokens == span.index

    assert "".join(never_pieces) == baseline.text
    assert never_last.finish_reason == "length"
    assert never_last.stop_reason is None


def test_stop_strings_in_chat_streams_match_the_whole_reply(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "List three primary colors."}]

    def chat(**kwargs: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kwargs
        )

    first = chat()
    reply = first.choices[0].message.content
    words = reply.split()
    assert len(words) >= 3, reply
    stop = words[2][:2]  # the first two characters of the third word
    cut = reply.find(stop)
    assert cut > 0
    whole, chunks = parallel(lambda: chat(stop=stop), lambda: list(chat(stop=stop, stream=True)))
    assert whole.choices[0].message.content == reply[:cut]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].stop_reason == stop
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == stop


def test_stop_token_ids_end_the_choice_on_that_token(
    client: OpenAI, baseline: Baseline, smol_tokenizer
) -> None:
    ids = [token_id(smol_tokenizer, token) for token in baseline.tokens]
    # The third distinct output token, at its first occurrence.
    position = sorted({ids.index(t) for t in ids})[2]
    stop_id = ids[position]
    before = "".join(baseline.tokens[:position])
    whole, (pieces, last), included = parallel(
        lambda: _complete(client, extra_body={"stop_token_ids": [stop_id]}),
        lambda: _streamed(client, extra_body={"stop_token_ids": [stop_id]}),
        lambda: _complete(
            client, extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True}
        ),
    )
    choice = whole.choices[0]
    assert choice.text == before
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop_id
    assert whole.usage.completion_tokens == position + 1

    assert "".join(pieces) == before
    assert last.finish_reason == "stop"
    assert last.stop_reason == stop_id

    assert included.choices[0].text == before + baseline.tokens[position]
    assert included.choices[0].stop_reason == stop_id


def test_a_stop_string_ending_after_min_tokens_is_found(client: OpenAI, baseline: Baseline) -> None:
    span = spanning_stop(baseline)
    # From token span.index - 1 (output token number span.index) through the first character
    # of token span.index + 1 (number span.index + 2), which is past min_tokens.
    i = span.index
    stop = baseline.tokens[i - 1][-2:] + baseline.tokens[i] + baseline.tokens[i + 1][0]
    assert baseline.text.find(stop) == span.cut
    reply = _complete(client, stop=[stop], extra_body={"min_tokens": i + 1})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == baseline.text[: span.cut]
    assert reply.choices[0].stop_reason == stop


def test_the_most_and_longest_stop_strings_allowed_still_match_right(
    client: OpenAI, baseline: Baseline
) -> None:
    """64 stop strings of 256 characters (the default limits), each a long near-miss of the
    output, plus the spanning stop: only the real one matches, streamed and not (the
    automaton's cost does not grow with them; before, 1,000 of 2,000 characters froze the
    server for half a minute)."""
    span = spanning_stop(baseline)
    text = baseline.text
    near_misses = [(text[: i % len(text)] + "#" + str(i)).ljust(256, "~") for i in range(63)]
    stops = [*near_misses, span.stop]
    assert len(stops) == 64 and max(map(len, stops)) == 256
    whole, (pieces, last) = parallel(
        lambda: _complete(client, stop=stops),
        lambda: _streamed(client, stop=stops),
    )
    assert whole.choices[0].text == text[: span.cut]
    assert whole.choices[0].stop_reason == span.stop
    assert "".join(pieces) == text[: span.cut]
    assert last.stop_reason == span.stop
