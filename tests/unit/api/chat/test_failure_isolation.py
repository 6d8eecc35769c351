"""A failure inside one request's tool parser, output format or chat template stays in
that request (issue 41): it gets its own error (a 500 with a generic message naming no
internals, the stream's error event, or a 400 for its template), and a request running
beside it, and the next one, are answered as if nothing happened. The real HTTP app,
the engine played by the test; the failing pieces are monkeypatched to raise."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.unit.conftest import ScriptedEngine, app_client
from trio_llm.api.anthropic.format import MessagesFormat
from trio_llm.api.chat import planner as plan_module
from trio_llm.api.responses.format import ResponsesFormat
from trio_llm.text.tokenizer import Tokenizer

SECRET = "/srv/secret/path.py"  # what the failure's text holds: never shown to a client
CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


class Bug(RuntimeError):
    """What the monkeypatched pieces raise."""


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise Bug(f"failed in {SECRET}")


class RaisingParser:
    """A tool-call parser that fails on the first text it is fed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.num_calls = 0

    feed = finish = parse = _raise


async def _exchange(
    tokenizer: Tokenizer, requests: list[tuple[str, dict[str, Any]]], **serving: Any
) -> list[httpx.Response]:
    """Every ``(path, body)`` sent at once, then one more plain chat request; the
    responses in that order (the last one's last)."""
    plain = ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 4})
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    engine = partial(ScriptedEngine, token_ids=hello)
    responses: list[httpx.Response | None] = [None] * (len(requests) + 1)
    async with app_client(tokenizer, engine, raise_app_exceptions=False, **serving) as (
        client,
        _fake,
    ):

        async def send(i: int, path: str, body: dict[str, Any]) -> None:
            responses[i] = await client.post(path, json=body)

        async with trio.open_nursery() as together:
            for i, (path, body) in enumerate([*requests, plain]):
                together.start_soon(send, i, path, body)
        responses.append(await client.post(plain[0], json=plain[1]))
    return [r for r in responses if r is not None]


def _assert_answered(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello"


def _assert_generic(text: str) -> None:
    assert SECRET not in text and "Traceback" not in text, text
    assert "internal error while" in text and "(Bug)" in text, text


async def test_a_raising_tool_parser_fails_its_request_only(
    smol_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_module, "make_parser", RaisingParser)
    with_tools = {"model": "m", "messages": CHAT, "tools": TOOLS, "max_tokens": 4}
    failed, streamed, beside, after = await _exchange(
        smol_tokenizer,
        [
            ("/v1/chat/completions", with_tools),
            ("/v1/chat/completions", {**with_tools, "stream": True}),
        ],
        tool_call_parser="hermes",
    )
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error"
    _assert_generic(error["message"])
    # The stream ends with its error event, then [DONE], as every stream does.
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    _assert_generic(json.loads(events[-2])["error"]["message"])
    _assert_answered(beside)
    _assert_answered(after)


async def test_a_raising_output_format_fails_its_request_only(
    smol_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MessagesFormat, "response", _raise)
    monkeypatch.setattr(ResponsesFormat, "stream_piece", _raise)
    message = {"model": "m", "messages": CHAT, "max_tokens": 4}
    failed, streamed, beside, after = await _exchange(
        smol_tokenizer,
        [
            ("/v1/messages", message),
            ("/v1/responses", {"model": "m", "input": "hi", "stream": True, "store": False}),
        ],
    )
    assert failed.status_code == 500
    assert failed.json()["type"] == "error"  # Anthropic's error body on its route
    _assert_generic(failed.json()["error"]["message"])
    assert "event: error" in streamed.text or "response.failed" in streamed.text
    _assert_generic(streamed.text)
    _assert_answered(beside)
    _assert_answered(after)


async def test_a_template_failing_on_a_request_is_its_400(
    smol_tokenizer: Tokenizer,
) -> None:
    """The operator's template raising on what one request sent (here: a tool whose name
    the template adds to a number) is that request's 400, not a server error."""
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if tools %}{{ tools[0].function.name + 1 }}{% endif %}"
    )
    tokenizer = Tokenizer(smol_tokenizer.backend, template)
    request = {"model": "m", "messages": CHAT, "tools": TOOLS, "tool_choice": "required"}
    failed, beside, after = await _exchange(tokenizer, [("/v1/chat/completions", request)])
    assert failed.status_code == 400, failed.text
    error = failed.json()["error"]
    assert error["param"] == "messages" and "cannot apply the chat template" in error["message"]
    _assert_answered(beside)
    _assert_answered(after)
