"""SSE framing: every event stays on one line, whatever text the model generated."""

from __future__ import annotations

import json

import pytest

from trio_llm.api.http.disconnect import sse_event

#: Characters str.splitlines() (httpx's aiter_lines) breaks on, control ones included.
LINE_BREAKS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("char", LINE_BREAKS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKS])
def test_an_event_is_one_line_for_eager_line_splitters(char: str) -> None:
    body = {"choices": [{"text": f"before{char}after", "index": 0}], "model": "m é ✓"}
    event = sse_event(json.dumps(body, ensure_ascii=False)).decode()
    lines = event.splitlines()
    assert lines[1:] == [""] and event.endswith("\n\n")
    assert json.loads(lines[0].removeprefix("data: ")) == body


def test_done_is_unchanged() -> None:
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
