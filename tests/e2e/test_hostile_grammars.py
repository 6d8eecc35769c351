"""Hostile grammars against a real server (issue 30): a choice list of 100,000 strings,
grammars and schemas that no output could complete, a grammar that fails in the middle
of its output. Each is answered with a 400 naming the field and giving a one-line reason,
never a "satisfied" empty output or the grammar library's internals; afterwards the
server is the same process, answering normally. Speed is not asserted here:
bench/grammar_limits.py measures how fast the refusals come and what a small new schema
waits beside hostile requests.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.test_hostile_clients import expected_answer, same_server  # noqa: F401
from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.usefixtures("same_server")

QUESTION = [{"role": "user", "content": "Pick one."}]

#: Issue 30's attack: 100,000 choices, 2.3 MB of JSON.
HUGE_CHOICE = [f"option number {i:06d} of the hostile list" for i in range(100_000)]

SELF = {"$ref": "#"}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
CYCLE_FORMAT = {"name": "cycle", "schema": CYCLE}
DEEP_FOREVER = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}

#: What no client error body may carry: llguidance's state dumps, panics, backtraces.
INTERNALS = ("<state>", "<backtrace>", "<non-verbose/>", "panic", "Tokens: ", "\n")


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def _assert_clean(message: str) -> None:
    for internal in INTERNALS:
        assert internal not in message, message


def _refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error
    _assert_clean(error["message"])
    return error["message"]


def test_a_choice_list_of_100000_strings_is_refused_naming_the_field(
    server: ServerProcess,
) -> None:
    body = {"messages": QUESTION, "structured_outputs": {"choice": HUGE_CHOICE}}
    assert len(json.dumps(body)) > 2_000_000
    message = _refusal(_post(server, "/v1/chat/completions", body), "structured_outputs")
    assert "characters, more than this server's limit" in message
    guided = {"prompt": "Pick one:", "guided_choice": HUGE_CHOICE[:5000]}
    message = _refusal(_post(server, "/v1/completions", guided), "guided_choice")
    assert "5,000 choices is more than this server's limit" in message


@pytest.mark.parametrize(
    ("field", "param", "reason"),
    [
        ({"guided_grammar": "start: start"}, "guided_grammar", "matches no string"),
        ({"structured_outputs": {"grammar": "start: start"}}, "structured_outputs", "no string"),
        ({"guided_json": SELF}, "guided_json", "matches no JSON value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": CYCLE_FORMAT}},
            "response_format",
            "matches no JSON value",
        ),
        ({"structured_outputs": {"json": DEEP_FOREVER}}, "structured_outputs", "no JSON value"),
    ],
)
def test_a_grammar_that_matches_nothing_is_refused_at_validation(
    server: ServerProcess, field: dict[str, Any], param: str, reason: str
) -> None:
    body = {"messages": QUESTION, "max_tokens": 8, **field}
    assert reason in _refusal(_post(server, "/v1/chat/completions", body), param)


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "loop"}}, "required"]
)
def test_a_tool_whose_schema_is_a_cycle_is_refused(server: ServerProcess, tool_choice: Any) -> None:
    tools = [{"type": "function", "function": {"name": "loop", "parameters": DEEP_FOREVER}}]
    body = {"messages": QUESTION, "tools": tools, "tool_choice": tool_choice, "max_tokens": 8}
    message = _refusal(_post(server, "/v1/chat/completions", body), "tools")
    assert "tools[0].function.parameters (loop)" in message and "no JSON value" in message


def test_the_other_apis_refuse_it_in_their_own_names(server: ServerProcess) -> None:
    anthropic = {
        "max_tokens": 8,
        "messages": QUESTION,
        "output_config": {"format": {"type": "json_schema", "schema": SELF}},
    }
    response = _post(server, "/v1/messages", anthropic)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith("output_config: ") and "no JSON value" in error["message"]
    _assert_clean(error["message"])
    text = {"format": {"type": "json_schema", "name": "x", "schema": CYCLE}}
    response = _post(server, "/v1/responses", {"input": "Pick one.", "text": text})
    assert "no JSON value" in _refusal(response, "text")


def test_a_grammar_that_fails_mid_output_is_an_error_without_internals(
    server: ServerProcess,
) -> None:
    """Every output of this grammar is infinitely deep; llguidance finds that out only
    after its three letters and a few forced braces, in the engine: an error naming the
    field with a one-line reason, in the body of a whole response and in the last event
    of a stream (never "stop")."""
    grammar = 'start: /[a-z]{3}/ t\nt: "{" t "}"'  # three letters, then braces forever
    body = {"messages": QUESTION, "max_tokens": 32, "guided_grammar": grammar}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar", error
    assert error["message"].startswith("structured output: ")
    _assert_clean(error["message"])
    streamed = _post(server, "/v1/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 200
    events = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])]
    assert "stop" not in finishes, events
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["message"].startswith("structured output: "), events
    assert errors[0]["param"] == "guided_grammar"
    _assert_clean(errors[0]["message"])
