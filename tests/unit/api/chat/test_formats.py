"""The JSON the output formats write, against the OpenAI API reference.

Each test builds a `Plan` and its `Choice`\\ s by hand (no server, no engine): the
choices are fed deltas that already carry their text, as the detokenizer child sends
them. The expected bodies are written from the API reference's field names
(``text_completion``, ``chat.completion``, ``chat.completion.chunk``), not copied from
output.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_llm.api.chat.format import ChatFormat, CompletionFormat
from trio_llm.api.chat.plan import Plan, ResponseFormat
from trio_llm.api.tools.parsers import make_parser
from trio_llm.messages import SamplingParams, TokenLogprobs
from trio_llm.text.choice import Choice, ChoiceDelta
from trio_llm.text.token_delta import TokenDelta
from trio_llm.text.tokenizer import Tokenizer

PROMPT = [1, 2, 3]
EOS = frozenset({2})


def _plan(
    response_format: ResponseFormat, tokenizer: Tokenizer, n: int = 1, **fields: Any
) -> tuple[Plan, list[Choice]]:
    """A plan of one prompt (`PROMPT`) with ``n`` choices, and its choices."""
    plan = Plan(response_format, "tiny", **fields)
    plan.add_prompt(PROMPT, [SamplingParams(max_tokens=8)] * n, "Hi")
    plan.response_id = response_format.new_id()
    plan.created = 1_700_000_000
    choices = [
        Choice(i, tokenizer, ids, params, EOS) for i, (ids, params) in enumerate(plan.requests)
    ]
    return plan, choices


def _feed(choice: Choice, *deltas: TokenDelta) -> list[ChoiceDelta]:
    pieces = [choice.process(delta) for delta in deltas]
    return [piece for piece in pieces if piece is not None]


def test_a_completion_body_is_a_text_completion(smol_tokenizer: Tokenizer) -> None:
    plan, choices = _plan(CompletionFormat(smol_tokenizer), smol_tokenizer, n=2)
    _feed(choices[0], TokenDelta([10, 11], "stop", text=" there", stop_reason=None))
    _feed(choices[1], TokenDelta([12], "length", text=" you", stop_reason=None))
    body = plan.format.response(plan, choices)
    assert body["id"].startswith("cmpl-")
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " there",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            },
            {
                "index": 1,
                "text": " you",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            },
        ],
        # The prompt is counted once, the output of every choice.
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_echo_puts_the_prompt_before_the_text(smol_tokenizer: Tokenizer) -> None:
    plan, choices = _plan(CompletionFormat(smol_tokenizer), smol_tokenizer, echo=True)
    _feed(choices[0], TokenDelta([10], "stop", text="!"))
    assert plan.format.response(plan, choices)["choices"][0]["text"] == "Hi!"


def test_a_chat_body_is_an_assistant_message(smol_tokenizer: Tokenizer) -> None:
    plan, choices = _plan(ChatFormat(smol_tokenizer), smol_tokenizer)
    _feed(choices[0], TokenDelta([10], text="Hello"), TokenDelta([2], "stop", text="."))
    body = plan.format.response(plan, choices)
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert (body["created"], body["model"]) == (1_700_000_000, "tiny")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello."},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["total_tokens"] == 5


def test_a_chat_stream_sends_the_role_first_and_usage_last(smol_tokenizer: Tokenizer) -> None:
    plan, choices = _plan(ChatFormat(smol_tokenizer), smol_tokenizer)
    events = []
    for delta in (TokenDelta([10], text="Hel"), TokenDelta([11], "length", text="lo")):
        for piece in _feed(choices[0], delta):
            events += plan.format.stream_piece(plan, choices[0], piece)
    events += plan.format.stream_end(plan, choices, include_usage=True)
    chunks = [data for name, data in events]
    assert all(name is None for name, _ in events)  # unnamed events: plain `data:` lines
    for chunk in chunks:
        assert chunk["id"] == plan.response_id
        assert chunk["object"] == "chat.completion.chunk"
        assert (chunk["created"], chunk["model"]) == (1_700_000_000, "tiny")
    first, second, last = (chunk["choices"] for chunk in chunks)
    assert first == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "Hel"},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    assert second[0]["delta"] == {"content": "lo"}  # no role after the first chunk
    assert second[0]["finish_reason"] == "length"
    assert last == []
    assert chunks[2]["usage"]["completion_tokens"] == 2
    assert plan.format.done_marker == "[DONE]"


def _hello_logprobs(format: Any, tokenizer: Tokenizer, logprob: float) -> Any:
    """The ``logprobs`` of a response whose one token, "Hello", had ``logprob`` and was
    its own only alternative."""
    plan, choices = _plan(format, tokenizer, num_top_logprobs=1)
    hello = tokenizer.encode("Hello", add_special_tokens=False)[0]
    entry = TokenLogprobs(hello, logprob, 1, [hello], [logprob])
    _feed(choices[0], TokenDelta([hello], "stop", logprobs=[entry], text="Hello"))
    return plan.format.response(plan, choices)["choices"][0]["logprobs"]


def test_chat_logprobs_list_each_token_with_its_alternatives(smol_tokenizer: Tokenizer) -> None:
    logprobs = _hello_logprobs(ChatFormat(smol_tokenizer), smol_tokenizer, -0.5)
    token = {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}
    assert logprobs == {"content": [{**token, "top_logprobs": [token]}]}


def test_completion_logprobs_are_the_legacy_lists(smol_tokenizer: Tokenizer) -> None:
    logprobs = _hello_logprobs(CompletionFormat(smol_tokenizer), smol_tokenizer, -0.25)
    assert logprobs["tokens"] == ["Hello"]
    assert logprobs["token_logprobs"] == [-0.25]
    assert logprobs["top_logprobs"] == [{"Hello": -0.25}]
    assert logprobs["text_offset"] == [0]


def test_a_tool_call_is_a_message_with_tool_calls(smol_tokenizer: Tokenizer) -> None:
    response_format = ChatFormat(smol_tokenizer, lambda: make_parser("hermes"))
    plan, choices = _plan(response_format, smol_tokenizer)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _feed(choices[0], TokenDelta([10], "stop", text=call))
    entry = plan.format.response(plan, choices)["choices"][0]
    assert entry["finish_reason"] == "tool_calls"
    message = entry["message"]
    assert message["role"] == "assistant"
    assert message["content"] is None
    [tool_call] = message["tool_calls"]
    assert tool_call["type"] == "function"
    assert isinstance(tool_call["id"], str) and tool_call["id"]
    assert tool_call["function"]["name"] == "get_weather"
    assert tool_call["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("cached", [0, 2])
def test_usage_counts_cached_prompt_tokens_once(smol_tokenizer: Tokenizer, cached: int) -> None:
    plan, choices = _plan(CompletionFormat(smol_tokenizer), smol_tokenizer, n=2)
    for choice in choices:
        _feed(choice, TokenDelta([10], "stop", text="x", num_cached_tokens=cached))
    usage = plan.format.response(plan, choices)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
    assert usage["prompt_tokens"] == 3
