"""`check_limits`: the counts checked on the raw JSON of every endpoint's body, each
refused with a 400 naming the endpoint's own field."""

from __future__ import annotations

from typing import Any

import pytest

from trio_llm.api.errors import APIError
from trio_llm.api.parsing import check_limits
from trio_llm.config import RequestLimits

LIMITS = RequestLimits(max_chat_messages=3, max_stop_strings=2)
TURN = {"role": "user", "content": "hi"}


def _param(data: dict[str, Any]) -> str | None:
    """The field a refusal names, or "ok" when the body passes."""
    try:
        check_limits(data, LIMITS, max_model_len=4096, vocab_size=1000)
    except APIError as exc:
        assert exc.status == 400
        return exc.param
    return "ok"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"messages": [TURN] * 3}, "ok"),
        ({"messages": [TURN] * 4}, "messages"),  # chat, Anthropic Messages
        ({"input": [TURN] * 4}, "input"),  # Responses items
        ({"input": "one text"}, "ok"),
        # Embeddings: token ids of one input, or texts, are not messages.
        ({"input": [101, 7592, 2088, 102]}, "ok"),
        ({"input": ["a", "b", "c", "d"]}, "ok"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop_sequences": ["a", "b", "c"]}, "stop_sequences"),
        ({"stop_sequences": ["x" * 300]}, "stop_sequences"),
    ],
)
def test_each_count_is_refused_by_its_own_name(data: dict[str, Any], expected: str) -> None:
    assert _param(data) == expected
