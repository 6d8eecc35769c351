"""The Messages API's translation into a chat completion (`MessagesRequest.to_chat`), on
requests Claude Code 2.1 really sent (tests/fixtures/claude_code, captured against this
server and a scripted upstream) and on hand-made edge cases: ``thinking``,
``output_config.effort``, ``context_management`` edits as Anthropic documents them,
``role: "system"`` turns and thinking blocks in ``messages``; and the pieces beside it
(system turns folded for templates that cannot show them, the ``request-id`` header,
Claude Code's tool schemas compiling)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from pydantic import ValidationError

from trio_llm.api.anthropic.context_editing import CLEARED_TOOL_RESULT
from trio_llm.api.anthropic.format import MessagesFormat, thinking_signature
from trio_llm.api.anthropic.request import MessagesRequest
from trio_llm.api.chat.planner import Plan
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.http.errors import APIError
from trio_llm.api.http.middleware import RequestIdMiddleware
from trio_llm.api.tools.parsers import make_parser
from trio_llm.frontend.preprocess import InputPreprocessor, fold_system_messages
from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.grammar_check import check_structured_output
from trio_llm.text.output import TextDelta
from trio_llm.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "claude_code"


def captured(name: str) -> dict[str, Any]:
    """The body of a captured Claude Code request."""
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


def chars(chat: ChatCompletionRequest) -> int:
    """A stand-in token count: the characters of the messages' contents."""
    return sum(len(m["content"]) for m in chat.template_messages())


# ---------------------------------------------------------------- captured requests


def test_claude_codes_first_request_translates() -> None:
    body = captured("first_request")
    chat = MessagesRequest.model_validate(body).to_chat(count_tokens=chars)
    roles = [m.role for m in chat.messages]
    # The system blocks, the user turn, then the system turn Claude Code sends after it.
    assert roles == ["system", "user", "system"]
    assert chat.messages[0].text() == "".join(block["text"] for block in body["system"])
    assert chat.messages[2].text() == body["messages"][1]["content"]
    assert chat.messages[1].text() == "".join(b["text"] for b in body["messages"][0]["content"])
    assert [tool.function.name for tool in chat.tools or ()] == [t["name"] for t in body["tools"]]
    assert chat.max_tokens == 32000 and chat.stream is True
    assert chat.translated.thinking == {"type": "adaptive"}
    assert chat.translated.effort == "high"
    assert chat.translated.fold_late_system is True


def test_claude_codes_second_request_sends_thinking_and_a_tool_result_back() -> None:
    body = captured("tool_result_request")
    chat = MessagesRequest.model_validate(body).to_chat(count_tokens=chars)
    assert [m.role for m in chat.messages] == ["system", "user", "system", "assistant", "tool"]
    call_turn, result = chat.messages[3], chat.messages[4]
    (call,) = call_turn.tool_calls or ()
    sent = body["messages"][2]["content"]
    assert call.id == sent[1]["id"] and call.function.name == "Read"
    assert json.loads(call.function.arguments) == sent[1]["input"]
    # keep: "all" keeps the thinking; it goes to the reasoning support, not into content.
    assert call_turn.model_extra["reasoning_content"] == sent[0]["thinking"]
    assert call_turn.text() == ""
    assert result.tool_call_id == sent[1]["id"]
    assert result.text() == body["messages"][3]["content"][0]["content"]


def test_claude_codes_title_request_has_effort_and_a_format() -> None:
    body = captured("title_request")
    chat = MessagesRequest.model_validate(body).to_chat()
    assert chat.tools is None
    schema = body["output_config"]["format"]["schema"]
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert chat.translated.effort == "high" and chat.translated.thinking is None


def test_claude_codes_tool_schemas_compile() -> None:
    """Its record fields say ``"propertyNames": {"type": "string"}``, a keyword llguidance
    does not implement (a 400 for every Claude Code request before): dropped, since JSON
    keys are strings anyway."""
    for tool in captured("first_request")["tools"]:
        check_structured_output(StructuredOutput("json", json.dumps(tool["input_schema"])))


def test_a_property_named_property_names_is_kept() -> None:
    schema = {
        "type": "object",
        "properties": {"propertyNames": {"type": "string"}},
        "required": ["propertyNames"],
        "additionalProperties": False,
    }
    from trio_llm.structured_output.schema_rewrites import without_vacuous_keywords

    assert without_vacuous_keywords(schema) is schema
    nested = {"type": "object", "additionalProperties": {"type": "object", "propertyNames": {}}}
    assert without_vacuous_keywords(nested) == {
        "type": "object",
        "additionalProperties": {"type": "object"},
    }
    # A propertyNames that constrains the keys stays (and llguidance refuses it, by name).
    pattern = {"type": "object", "propertyNames": {"pattern": "^a"}}
    assert without_vacuous_keywords(pattern) is pattern


# ---------------------------------------------------------------- hand-made requests


def request(messages: list[dict[str, Any]], **fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 16, "messages": messages, **fields}
    )


TOOLS = [
    {"name": "read", "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}}},
    {"name": "keep", "input_schema": {"type": "object"}},
]


def tool_loop(n: int, name: str = "read", *, thinking: bool = False) -> list[dict[str, Any]]:
    """A user question, then ``n`` rounds of an assistant call (``t0``, ``t1``, ...) and
    its result (``result 0``, ...), then a final user turn."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(n):
        call = {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"p": f"file{i}"}}
        blocks = [{"type": "thinking", "thinking": f"thought {i}", "signature": "x"}, call]
        turns.append({"role": "assistant", "content": blocks if thinking else [call]})
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"result {i}"}
        turns.append({"role": "user", "content": [result]})
    return turns


def results(chat: ChatCompletionRequest) -> list[str]:
    return [m.text() for m in chat.messages if m.role == "tool"]


def arguments(chat: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [
        json.loads(call.function.arguments)
        for m in chat.messages
        if m.role == "assistant"
        for call in m.tool_calls or ()
    ]


def reasoning(chat: ChatCompletionRequest) -> list[str | None]:
    return [
        (m.model_extra or {}).get("reasoning_content")
        for m in chat.messages
        if m.role == "assistant"
    ]


def test_thinking_of_earlier_turns_is_dropped_by_default() -> None:
    """Without a clear_thinking edit, Anthropic keeps the thinking of the last assistant
    turn with thinking only."""
    chat = request(tool_loop(3, thinking=True), tools=TOOLS).to_chat()
    assert reasoning(chat) == [None, None, "thought 2"]


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        ("all", ["thought 0", "thought 1", "thought 2"]),
        ({"type": "thinking_turns", "value": 2}, [None, "thought 1", "thought 2"]),
        ({"type": "thinking_turns", "value": 0}, [None, None, None]),
        (None, [None, None, "thought 2"]),  # the edit's default: 1
    ],
)
def test_clear_thinking_keeps_the_last_turns_asked(keep: Any, expected: list[Any]) -> None:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    chat = request(
        tool_loop(3, thinking=True), tools=TOOLS, context_management={"edits": [edit]}
    ).to_chat()
    assert reasoning(chat) == expected


def test_redacted_thinking_is_accepted_and_never_shown() -> None:
    turns = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "again"},
    ]
    chat = request(
        turns, context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    ).to_chat()
    assert [m.text() for m in chat.messages] == ["hi", "hello", "again"]
    assert "ZW5jcnlwdGVk" not in json.dumps(chat.template_messages())


def clear_tool_uses(**options: Any) -> dict[str, Any]:
    return {"context_management": {"edits": [{"type": "clear_tool_uses_20250919", **options}]}}


def test_clear_tool_uses_clears_all_but_the_last_kept_results() -> None:
    trigger = {"type": "tool_uses", "value": 2}
    keep = {"type": "tool_uses", "value": 2}
    chat = request(
        tool_loop(5), tools=TOOLS, **clear_tool_uses(trigger=trigger, keep=keep)
    ).to_chat()
    assert results(chat) == [CLEARED_TOOL_RESULT] * 3 + ["result 3", "result 4"]
    # By default the calls' inputs stay.
    assert arguments(chat) == [{"p": f"file{i}"} for i in range(5)]


def test_clear_tool_uses_waits_for_its_trigger() -> None:
    trigger = {"type": "tool_uses", "value": 5}
    chat = request(tool_loop(5), tools=TOOLS, **clear_tool_uses(trigger=trigger)).to_chat()
    assert results(chat) == [f"result {i}" for i in range(5)]


def test_clear_tool_uses_default_trigger_is_100k_input_tokens() -> None:
    edit = clear_tool_uses()
    small = request(tool_loop(5), tools=TOOLS, **edit).to_chat(count_tokens=lambda chat: 100_000)
    assert results(small) == [f"result {i}" for i in range(5)]
    large = request(tool_loop(5), tools=TOOLS, **edit).to_chat(count_tokens=lambda chat: 100_001)
    # keep defaults to 3 tool uses.
    assert results(large) == [CLEARED_TOOL_RESULT] * 2 + ["result 2", "result 3", "result 4"]


def test_clear_tool_uses_counts_the_prompt_it_would_send() -> None:
    counted: list[int] = []

    def count(chat: ChatCompletionRequest) -> int:
        counted.append(chars(chat))
        return counted[-1]

    trigger = {"type": "input_tokens", "value": 10}
    body = request(tool_loop(4), tools=TOOLS, **clear_tool_uses(trigger=trigger))
    chat = body.to_chat(count_tokens=count)
    assert counted == [chars(request(tool_loop(4), tools=TOOLS).to_chat())]
    assert results(chat) == [CLEARED_TOOL_RESULT, "result 1", "result 2", "result 3"]


def test_clear_at_least_leaves_the_prompt_when_too_little_would_go() -> None:
    turns = tool_loop(4)
    for turn in turns[2::2]:
        turn["content"][0]["content"] = "x" * 100
    freed = 100 - len(CLEARED_TOOL_RESULT)  # one result cleared (keep 3 of 4)
    for at_least, cleared in ((freed + 1, False), (freed, True)):
        options = clear_tool_uses(
            trigger={"type": "tool_uses", "value": 0},
            clear_at_least={"type": "input_tokens", "value": at_least},
        )
        chat = request(turns, tools=TOOLS, **options).to_chat(count_tokens=chars)
        assert (results(chat)[0] == CLEARED_TOOL_RESULT) is cleared
        assert results(chat)[1:] == ["x" * 100] * 3


def test_clear_tool_uses_spares_excluded_tools_and_clears_inputs_when_asked() -> None:
    turns = tool_loop(2, "keep") + tool_loop(2)[1:]
    # Calls t0, t1 (keep), then t0, t1 (read): ids repeat, so make the last two unique.
    for turn in turns[5:]:
        for block in turn["content"]:
            for key in ("id", "tool_use_id"):
                if key in block:
                    block[key] = block[key] + "r"
    trigger = {"type": "tool_uses", "value": 0}
    keep = {"type": "tool_uses", "value": 1}
    chat = request(
        turns,
        tools=TOOLS,
        **clear_tool_uses(
            trigger=trigger, keep=keep, exclude_tools=["keep"], clear_tool_inputs=True
        ),
    ).to_chat()
    assert results(chat) == ["result 0", "result 1", CLEARED_TOOL_RESULT, "result 1"]
    assert arguments(chat) == [{"p": "file0"}, {"p": "file1"}, {}, {"p": "file1"}]
    # clear_tool_inputs may name the tools whose inputs go.
    chat = request(
        tool_loop(3),
        tools=TOOLS,
        **clear_tool_uses(trigger=trigger, keep=keep, clear_tool_inputs=["other"]),
    ).to_chat()
    assert arguments(chat) == [{"p": f"file{i}"} for i in range(3)]
    assert results(chat) == [CLEARED_TOOL_RESULT, CLEARED_TOOL_RESULT, "result 2"]


@pytest.mark.parametrize(
    "context_management",
    [
        {"edits": [{"type": "compact_20260112"}]},
        {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]},
        {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens"}}]},
        {"edits": [{"type": "clear_tool_uses_20250919", "unknown": 1}]},
    ],
)
def test_an_edit_not_understood_is_refused_naming_context_management(
    context_management: dict[str, Any],
) -> None:
    with pytest.raises(ValidationError) as caught:
        request([{"role": "user", "content": "x"}], context_management=context_management)
    assert caught.value.errors()[0]["loc"][0] == "context_management"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"output_config": {"effort": "extreme"}}, "output_config"),
    ],
)
def test_malformed_thinking_and_effort_are_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request([{"role": "user", "content": "x"}], **fields)
    assert caught.value.errors()[0]["loc"][0] == named


def test_thinking_and_effort_are_kept_for_the_reasoning_support() -> None:
    chat = request(
        [{"role": "user", "content": "x"}],
        thinking={"type": "enabled", "budget_tokens": 2048},
        output_config={"effort": "low"},
    ).to_chat()
    assert chat.translated.thinking == {"type": "enabled", "budget_tokens": 2048}
    assert chat.translated.effort == "low"
    disabled = request([{"role": "user", "content": "x"}], thinking={"type": "disabled"})
    assert disabled.to_chat().translated.thinking == {"type": "disabled"}


def test_thinking_in_a_user_turn_is_refused() -> None:
    turns = [{"role": "user", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}]}]
    with pytest.raises(APIError) as caught:
        request(turns).to_chat()
    assert caught.value.status == 400 and "assistant" in caught.value.message


def test_system_turns_keep_their_place_and_take_text_blocks() -> None:
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "late"}]},
        {"role": "user", "content": "c"},
    ]
    chat = request(turns, system="first").to_chat()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "first"),
        ("user", "a"),
        ("assistant", "b"),
        ("system", "late"),
        ("user", "c"),
    ]


# ---------------------------------------------------------------- system turns, rendered

#: Templates that refuse a system message after the first, leave it out, or show it.
REFUSING = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role not supported here') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
DROPPING = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}"
    "<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SHOWING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "a"},
    {"role": "system", "content": "late"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (REFUSING, "<system>late\n<user>a\n<assistant>b\n<user>c\n<assistant>"),
        (DROPPING, "<system>late\n<user>a\n<assistant>b\n<user>c\n<assistant>"),
        (SHOWING, "<user>a\n<system>late\n<assistant>b\n<user>c\n<assistant>"),
    ],
    ids=["refusing", "dropping", "showing"],
)
def test_a_late_system_turn_is_folded_where_the_template_cannot_show_it(
    smol_tokenizer: Tokenizer, template: str, expected: str
) -> None:
    inputs = InputPreprocessor(Tokenizer(smol_tokenizer.backend, template), 8192, 49152)
    assert inputs.chat_text(CONVERSATION, fold_late_system=True) == expected


def test_the_smollm2_template_shows_a_late_system_turn_in_place(
    smol_tokenizer: Tokenizer,
) -> None:
    assert smol_tokenizer.renders_late_system()
    inputs = InputPreprocessor(smol_tokenizer, 8192, 49152)
    text = inputs.chat_text(CONVERSATION, fold_late_system=True)
    assert text.index("<|im_start|>user\na") < text.index("<|im_start|>system\nlate")


def test_fold_system_messages_appends_late_ones_to_the_first() -> None:
    messages = [
        {"role": "system", "content": "s0"},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "s1"},
        {"role": "system", "content": "s2"},
    ]
    assert fold_system_messages(messages) == [
        {"role": "system", "content": "s0\n\ns1\n\ns2"},
        {"role": "user", "content": "a"},
    ]
    assert fold_system_messages(messages[:2]) == messages[:2]


# ---------------------------------------------------------------- the message written back


def message_format() -> tuple[MessagesFormat, Plan]:
    form = MessagesFormat(None, lambda: make_parser("hermes"))  # type: ignore[arg-type]
    plan = Plan(format=form, model="m", response_id="msg_1", created=1, prompt_lengths=[9])
    return form, plan


def output(text: str, finish_reason: str | None = "stop", **fields: Any) -> Any:
    """A finished choice whose model output is ``text``."""
    return SimpleNamespace(
        index=0,
        text=text,
        finish_reason=finish_reason,
        stop_reason=None,
        num_output_tokens=5,
        num_cached_tokens=4,
        all_logprobs=[],
        **fields,
    )


def test_a_message_with_text_and_a_tool_use_block() -> None:
    """Anthropic's Message object: content blocks in order, ``stop_reason`` ``tool_use``,
    ``usage`` whose input, cache-creation and cache-read counts add up to the prompt."""
    form, plan = message_format()
    text = 'Let me look.<tool_call>{"name": "read", "arguments": {"path": "a.txt"}}</tool_call>'
    body = form.response(plan, [output(text, "tool_calls")])
    (call_id,) = [block["id"] for block in body["content"] if block["type"] == "tool_use"]
    assert body == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": call_id, "name": "read", "input": {"path": "a.txt"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4,
            "output_tokens": 5,
        },
    }


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", "\n\nHuman:", ("stop_sequence", "\n\nHuman:")),
        ("length", None, ("max_tokens", None)),
    ],
)
def test_stop_reasons_are_anthropics(finish_reason: str, stop_reason: Any, expected: Any) -> None:
    form, plan = message_format()
    choice = output("hi", finish_reason)
    choice.stop_reason = stop_reason
    body = form.response(plan, [choice])
    assert (body["stop_reason"], body["stop_sequence"]) == expected


def test_tool_use_input_too_deep_to_decode_is_an_empty_object() -> None:
    """Arguments nested deeper than the JSON decoder goes (a model steered into ~5,000
    brackets) are treated as invalid JSON: ``{}``, not a 500."""
    form, plan = message_format()
    deep = "[" * 5000 + "]" * 5000
    text = f'<tool_call>{{"name": "read", "arguments": {deep}}}</tool_call>'
    body = form.response(plan, [output(text, "tool_calls")])
    assert [(block["type"], block["input"]) for block in body["content"]] == [("tool_use", {})]


def test_a_streamed_message_has_anthropics_events_in_order() -> None:
    form, plan = message_format()
    choice = output("", None)
    events = form.stream_start(plan, [choice])
    for k, piece in enumerate(["Hel", "lo"]):
        last = k == 1
        choice.text += piece
        choice.finish_reason = "stop" if last else None
        delta = TextDelta(piece, finish_reason="stop" if last else None)
        events += form.stream_piece(plan, choice, delta)  # type: ignore[arg-type]
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] == 5
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert deltas == [{"type": "text_delta", "text": "Hel"}, {"type": "text_delta", "text": "lo"}]
    assert events[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 5},
    }


def test_a_thinking_signature_is_the_sha256_of_the_thinking() -> None:
    assert thinking_signature("abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


# ---------------------------------------------------------------- request-id


@pytest.mark.parametrize(
    ("path", "has_id"), [("/v1/messages", True), ("/v1/chat/completions", False)]
)
def test_anthropic_responses_carry_a_request_id(path: str, has_id: bool) -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    trio.run(RequestIdMiddleware(app), scope, receive, send)
    headers = dict(sent[0]["headers"])
    if has_id:
        request_id = headers[b"request-id"].decode()
        assert request_id.startswith("req_") and len(request_id) == 28
        assert scope["state"]["request_id"] == request_id
    else:
        assert b"request-id" not in headers
