"""Tool calling without an engine: the parsers (`trio_llm.api.tools.parsers`), the grammar of a
forced call, the tool-aware template, and the HTTP layer against a scripted engine that
"generates" a given text, so streamed and whole responses can be compared exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.conftest import ScriptedEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.tools.calls import NamedCallParser, ParsedDelta, ToolCallParser
from trio_llm.api.tools.grammar import tool_call_grammar
from trio_llm.api.tools.parsers import HermesParser, make_parser, required_parser
from trio_llm.engine.grammar_compiler import GrammarCompiler
from trio_llm.messages import AddRequest, EngineReady
from trio_llm.text.chat_template import render_messages, shipped_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}

# ---------------------------------------------------------------- parsers

#: (parser, model output, expected content, expected calls as (name, arguments)).
PARSED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"note": "a } in a string", "n": [1, {"x": "]"}]}}\n</tool_call>\n'
        '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>',
        "Let me check.",
        [
            ("get_weather", '{"city": "Paris", "note": "a } in a string", "n": [1, {"x": "]"}]}'),
            ("add", '{"a":1,"b":2}'),
        ],
    ),
    (
        "hermes",
        "Plain text with <tool_ in it and a < sign.",
        "Plain text with <tool_ in it and a < sign.",
        [],
    ),
    # keys in the other order: decoded whole at the end of the object
    (
        "hermes",
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call> done',
        "done",
        [("f", '{"x": 1}')],
    ),
    # arguments given as a JSON string
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [("f", '{"x": 1}')],
    ),
    # not a call: given back as content
    ("hermes", "<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    # cut off inside the arguments (max_tokens): the call keeps what came
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1', None, [("f", '{"x": 1')]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"x": 1}'), ("g", "{}")],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
        None,
        [("f", '{"x": 1}')],
    ),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    ("llama3_json", '{"x": 1} is an object', '{"x": 1} is an object', []),
    (
        "required",
        '[{"name":"f","arguments":{"a":"b"}},{"name":"g","arguments":{}}]',
        None,
        [("f", '{"a":"b"}'), ("g", "{}")],
    ),
    ("named", '{"a":1}', None, [("f", '{"a":1}')]),
]


def _parser(kind: str) -> ToolCallParser:
    if kind == "required":
        return required_parser()
    if kind == "named":
        return NamedCallParser("f")
    return make_parser(kind)


def _summary(parsed: ParsedDelta) -> tuple[str | None, list[tuple[str, str]]]:
    calls = parsed.tool_calls()
    content = parsed.content or (None if calls else "")
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("kind", "text", "content", "calls"), PARSED)
def test_a_whole_output_parses_into_content_and_calls(kind, text, content, calls) -> None:
    assert _summary(_parser(kind).parse(text)) == (content, calls)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_of_the_output_gives_the_same_calls_and_content(data) -> None:
    """A stream's pieces (however the tokens fall) add up to the whole response."""
    kind, text, content, calls = data.draw(st.sampled_from(PARSED))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    parser = _parser(kind)
    total = ParsedDelta()
    ids: dict[int, str] = {}
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece = parser.feed(text[start:end])
        for call in piece.calls:  # the id and name come once, on a call's first piece
            if call.id is not None:
                assert call.index not in ids and call.name
                ids[call.index] = call.id
            else:
                assert call.index in ids
        total.extend(piece)
    total.extend(parser.finish())
    assert _summary(total) == (content, calls)
    assert len(set(ids.values())) == len(calls)


#: Brackets nested deeper than Python's JSON decoder goes (about 1,000 levels).
DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("hermes", f'<tool_call>{{"arguments": {DEEP}, "name": "f"}}</tool_call>'),
        ("llama3_json", f'{{"parameters": {DEEP}, "name": "f"}}'),
        ("hermes", '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>'),
    ],
    ids=["hermes-deep", "llama3_json-deep", "bad-escape-in-name"],
)
def test_model_output_the_decoder_cannot_read_is_text(kind: str, text: str) -> None:
    """A model steered into deeply nested brackets (or an invalid escape in a call's
    name) writes no call: the text is content, as for invalid JSON, not a 500."""
    assert _summary(_parser(kind).parse(text)) == (text, [])


def test_deeply_nested_arguments_in_the_usual_key_order_stream_as_text() -> None:
    text = f'<tool_call>{{"name": "f", "arguments": {DEEP}}}</tool_call>'
    assert _summary(_parser("hermes").parse(text)) == (None, [("f", DEEP)])


# ---------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def grammars(real_model_dir: Path, smol_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(real_model_dir, 49152, frozenset({2}))


def _accepts(grammars: GrammarCompiler, spec, text: str, smol_tokenizer) -> bool:
    matcher = grammars.matcher(spec)
    tokens = smol_tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_a_required_call_is_held_to_the_functions_and_their_schemas(
    grammars: GrammarCompiler, smol_tokenizer
) -> None:
    functions = {"get_weather": WEATHER, "add": {"type": "object", "properties": {}}}
    spec = tool_call_grammar(functions, None, parallel_tool_calls=True)
    ok = (
        '[{"name":"get_weather","arguments":{"city":"Oslo","days":2}},'
        '{"name":"add","arguments":{}}]'
    )
    assert _accepts(grammars, spec, ok, smol_tokenizer)
    for bad in (
        "[]",  # at least one call
        '[{"name":"get_time","arguments":{}}]',  # no such function
        '[{"name":"get_weather","arguments":{"days":2}}]',  # city is required
        '[{"name":"get_weather","arguments":{"city":"Oslo","days":0}}]',  # minimum 1
    ):
        assert not _accepts(grammars, spec, bad, smol_tokenizer), bad
    single = tool_call_grammar(functions, None, parallel_tool_calls=False)
    assert not _accepts(grammars, single, ok, smol_tokenizer)
    named = tool_call_grammar(functions, "get_weather", parallel_tool_calls=True)
    assert _accepts(grammars, named, '{"city":"Oslo"}', smol_tokenizer)
    assert not _accepts(grammars, named, '{"days":3}', smol_tokenizer)


# ---------------------------------------------------------------- template

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": " x "},
        {"role": "user", "content": ""},
    ],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "then"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_tool_template_without_tools_renders_as_smollm2s_own(
    smol_tokenizer, conversation, add_generation_prompt
) -> None:
    own = smol_tokenizer.chat_template
    assert "tools" not in own
    shipped = shipped_template("smollm2_tools.jinja")
    assert smol_tokenizer.tool_template == shipped
    kwargs = {"add_generation_prompt": add_generation_prompt}
    assert render_messages(shipped, conversation, **kwargs) == render_messages(
        own, conversation, **kwargs
    )


def test_the_tool_template_shows_tools_calls_and_results(smol_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3 C", "tool_call_id": "c1"},
    ]
    text = smol_tokenizer.render_chat(messages, tools=tools)
    assert json.dumps(tools[0]["function"]) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<|im_start|>ipython\n3 C<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- HTTP, scripted engine

INFO = EngineReady("/model", 4096, 256, 16, [2], 49152, "float32", 1)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b"}},
]
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


async def _post(
    smol_tokenizer, body: dict[str, Any], text: str = "", parser: str | None = "hermes"
):
    """POST a chat request to an app whose engine 'generates' ``text``."""
    async with trio.open_nursery() as nursery:
        engine, stream = engine_client_pair(INFO)
        fake = ScriptedEngine(stream, smol_tokenizer.encode(text, add_special_tokens=False))
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        serving = ModelServing(engine, smol_tokenizer, ("m",), tool_call_parser=parser)
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/chat/completions", json=body)
        nursery.cancel_scope.cancel()
    return response, fake


def _streamed(response: httpx.Response) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Content, calls and finish_reason of a streamed response, accumulated as the openai
    SDK does."""
    content, calls, finish = "", {}, None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if "id" in piece:
                    calls[piece["index"]] = {
                        "id": piece["id"],
                        "type": "function",
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


HERMES_OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("tool_choice", "text", "calls"),
    [
        (None, HERMES_OUTPUT, [("get_weather", '{"city": "Oslo"}')]),
        (
            "required",
            '[{"name":"add","arguments":{}},{"name":"get_weather","arguments":{"city":"Oslo"}}]',
            [("add", "{}"), ("get_weather", '{"city":"Oslo"}')],
        ),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city":"Oslo"}',
            [("get_weather", '{"city":"Oslo"}')],
        ),
    ],
)
async def test_streamed_and_whole_responses_carry_the_same_calls(
    smol_tokenizer, tool_choice, text, calls
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": TOOLS}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    whole, _ = await _post(smol_tokenizer, body, text)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == calls
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )
    streamed, _ = await _post(smol_tokenizer, {**body, "stream": True}, text)
    content, stream_calls, finish = _streamed(streamed)
    assert finish == "tool_calls"
    assert content == message["content"]
    strip_ids = [{**c, "id": None} for c in stream_calls]
    assert strip_ids == [{**c, "id": None} for c in message["tool_calls"]]


async def test_a_forced_call_reaches_the_engine_as_a_grammar(smol_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}
    response, fake = await _post(smol_tokenizer, body, '[{"name":"add","arguments":{}}]')
    assert response.status_code == 200
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    assert added.params.structured_output is not None
    assert added.params.structured_output.kind == "grammar"
    prompt = smol_tokenizer.decode(added.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt  # the template showed the tools


async def test_tool_choice_none_answers_in_text(smol_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": "none"}
    response, _ = await _post(smol_tokenizer, body, HERMES_OUTPUT)
    message = response.json()["choices"][0]["message"]
    assert message["content"] == HERMES_OUTPUT
    assert "tool_calls" not in message
    assert response.json()["choices"][0]["finish_reason"] == "stop"


async def test_tool_calls_and_results_in_the_history_reach_the_prompt(smol_tokenizer) -> None:
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C and snow"},
    ]
    body = {"model": "m", "messages": messages, "tools": TOOLS}
    response, fake = await _post(smol_tokenizer, body, "It is 3 C and snowing.")
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == "It is 3 C and snowing."
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    prompt = smol_tokenizer.decode(added.prompt_token_ids, skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<|im_start|>ipython\n3 C and snow<|im_end|>" in prompt


BAD_REQUESTS = [
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "bad name!"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "repeated"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}
            ]
        },
        "tools",
        "strng",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"type": "array", "uniqueItems": True}}},
                    },
                }
            ]
        },
        "tools",
        "uniqueItems",
    ),
    ({"tools": [{"type": "function"}]}, "tools", None),
    (
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
        "128",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools",
        'type "object"',
    ),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", None),
    ({"tools": TOOLS, "guided_regex": "a+"}, "guided_regex", "only a JSON format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    (
        {"messages": [{"role": "tool", "content": "3 C"}]},  # no tool_call_id
        "messages",
        None,
    ),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD_REQUESTS)
async def test_bad_tool_requests_get_a_400_naming_the_field(
    smol_tokenizer, fields, param, says
) -> None:
    body = {"model": "m", "messages": QUESTION, **fields}
    response, fake = await _post(smol_tokenizer, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0].split("[")[0] == param, error
    if says is not None:
        assert says in error["message"]
    assert not fake.added


async def test_auto_needs_a_server_with_a_tool_call_parser(smol_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS}
    response, _ = await _post(smol_tokenizer, body, parser=None)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in error["message"]
    forced = {**body, "tool_choice": "required"}
    response, _ = await _post(
        smol_tokenizer, forced, '[{"name":"add","arguments":{}}]', parser=None
    )
    assert response.status_code == 200


async def test_tools_on_completions_are_refused(smol_tokenizer) -> None:
    async with trio.open_nursery() as nursery:
        engine, _ = engine_client_pair(INFO)
        nursery.start_soon(engine.route_outputs)
        serving = ModelServing(engine, smol_tokenizer, ("m",), tool_call_parser="hermes")
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "m", "prompt": "hi", "tools": TOOLS}
            response = await client.post("/v1/completions", json=body)
        nursery.cancel_scope.cancel()
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"


def test_parsers_are_refused_by_unknown_name() -> None:
    with pytest.raises(ValueError, match="mistral"):
        make_parser("mistral")
    assert isinstance(make_parser("hermes"), HermesParser)
