"""Tools and a response format in one request (issue 31): the grammar of ``tool_choice:
"auto"`` with a format (calls or a formatted answer), forced calls that ignore the format,
object schemas closed as agents mean them, and calls cut off by ``max_tokens``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from tests.unit.api.tools.test_tool_calls import INFO, QUESTION, TOOLS, WEATHER, _streamed
from tests.unit.conftest import STATS, FakeEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.tools.calls import ParsedDelta
from trio_llm.api.tools.grammar import calls_or_answer_grammar
from trio_llm.api.tools.parsers import make_parser, required_parser
from trio_llm.messages import AddRequest, RequestOutput, StepOutputs, StructuredOutput
from trio_llm.structured_output.grammar_check import _BYTE_VOCAB, _byte_tokenizer, checked_matcher
from trio_llm.structured_output.schema_rewrites import close_object_schemas

#: The answer format of an agent's typed output (pydantic writes ``$defs`` and ``$ref``).
ANSWER = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}, "temperature": {"type": "integer"}},
    "required": ["city", "temperature"],
    "$defs": {"City": {"type": "string", "maxLength": 20}},
}
FUNCTIONS = {"get_weather": close_object_schemas(WEATHER), "add": {"type": "object"}}

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'


def _accepts(spec: StructuredOutput, text: str) -> bool:
    """Whether ``text`` is a whole output of ``spec``'s grammar (over bytes: no model)."""
    matcher = checked_matcher(spec, _byte_tokenizer(), _BYTE_VOCAB)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


# ---------------------------------------------------------------- the grammar


def test_auto_with_a_format_is_calls_in_the_parsers_format_or_a_formatted_answer() -> None:
    answer = StructuredOutput("json", json.dumps(close_object_schemas(ANSWER)))
    spec = calls_or_answer_grammar(FUNCTIONS, answer, "hermes", parallel_tool_calls=True)
    add = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    for ok in (
        '{"city":"Oslo","temperature":3}',
        HERMES_CALL,
        f"{HERMES_CALL}\n{add}",
    ):
        assert _accepts(spec, ok), ok
    for bad in (
        "It is 3 C in Oslo.",  # neither
        '{"city":"Oslo"}',  # the answer misses a required property
        '{"city":"Oslo","temperature":3,"wind":1}',  # nor may it add one
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"days":2}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo","x":1}}\n</tool_call>',
        HERMES_CALL + '{"city":"Oslo","temperature":3}',  # calls, then no answer
        'Sure: {"city":"Oslo","temperature":3}',
    ):
        assert not _accepts(spec, bad), bad
    single = calls_or_answer_grammar(FUNCTIONS, answer, "hermes", parallel_tool_calls=False)
    assert _accepts(single, HERMES_CALL)
    assert not _accepts(single, f"{HERMES_CALL}\n{add}")


def test_llama3_json_calls_and_a_json_object_answer() -> None:
    spec = calls_or_answer_grammar(
        FUNCTIONS, StructuredOutput("json_object"), "llama3_json", parallel_tool_calls=True
    )
    call = '{"name": "get_weather", "parameters": {"city":"Oslo"}}'
    assert _accepts(spec, call)
    assert _accepts(spec, f'{call}; {{"name": "add", "parameters": {{}}}}')
    assert _accepts(spec, '{"anything":[1,2]}')
    assert not _accepts(spec, "[1, 2]")
    assert not _accepts(spec, '{"name": "get_weather", "parameters": {"days":1}}')


def test_the_parser_reads_the_grammars_calls_and_answers() -> None:
    names = frozenset(FUNCTIONS)
    calls = make_parser("hermes", names=names, held=True).parse(HERMES_CALL)
    assert calls.content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls.tool_calls()] == [
        ("get_weather", '{"city":"Oslo"}')
    ]
    answer = '{"city":"Oslo","temperature":3}'
    parsed = make_parser("llama3_json", names=names, held=True).parse(answer)
    assert (parsed.content, parsed.tool_calls()) == (answer, [])
    # An answer whose format has a "name" key is no call unless it names a tool.
    named = '{"name": "Oslo", "parameters": {"x": 1}}'
    parsed = make_parser("llama3_json", names=names, held=True).parse(named)
    assert (parsed.content, parsed.tool_calls()) == (named, [])


# ---------------------------------------------------------------- requests


def _request(hermes: bool = True, close: bool = True, **fields: Any) -> ChatCompletionRequest:
    body = {"messages": QUESTION, "tools": TOOLS, **fields}
    request = ChatCompletionRequest.model_validate(body)
    request.set_server_options(
        tool_call_parser="hermes" if hermes else None, disable_additional_properties=close
    )
    return request


FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}


def test_a_request_with_tools_and_a_format_gets_the_one_grammar() -> None:
    request = _request(response_format=FORMAT)
    spec = request.structured_output()
    assert spec is not None and spec.kind == "grammar"
    assert request.held_calls_or_answer
    assert _accepts(spec, HERMES_CALL)
    assert _accepts(spec, '{"city":"Oslo","temperature":3}')
    # A forced call: the call's schema applies, not the format.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = _request(response_format=FORMAT, tool_choice=choice)
        spec = forced.structured_output()
        assert spec is not None and not forced.held_calls_or_answer
        assert not _accepts(spec, '{"city":"Oslo","temperature":3}')
    # tool_choice "none": the format alone.
    none = _request(response_format=FORMAT, tool_choice="none").structured_output()
    assert none is not None and none.kind == "json"
    # A server without --tool-call-parser: no grammar here (the server refuses "auto").
    assert _request(hermes=False, response_format=FORMAT).structured_output() is None


def _schema_of(request: ChatCompletionRequest) -> dict[str, Any]:
    spec = request.structured_output()
    assert spec is not None and spec.kind == "json"
    return json.loads(spec.spec)


def test_formats_and_forced_calls_generate_only_listed_properties() -> None:
    open_schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": open_schema}}
    closed = _schema_of(
        ChatCompletionRequest.model_validate({"messages": QUESTION, "response_format": fmt})
    )
    assert closed["additionalProperties"] is False
    # The JSON-Schema-literal reading (disable_additional_properties false) ...
    literal = _request(close=False, response_format=fmt, tool_choice="none")
    assert "additionalProperties" not in _schema_of(literal)
    # ... except for strict formats and strict functions.
    strict_fmt = {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}
    strict = _request(close=False, response_format=strict_fmt, tool_choice="none")
    assert _schema_of(strict)["additionalProperties"] is False
    named = {"type": "function", "function": {"name": "get_weather"}}
    call = _request(tool_choice=named).structured_output()
    assert call is not None and json.loads(call.spec)["additionalProperties"] is False
    tools = [{"type": "function", "function": {"name": "f", "parameters": open_schema}}]
    loose = _request(
        close=False, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}
    )
    assert "additionalProperties" not in json.loads(loose.structured_output().spec)
    tools[0]["function"]["strict"] = True
    tight = _request(
        close=False, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}
    )
    assert json.loads(tight.structured_output().spec)["additionalProperties"] is False


def test_closing_reaches_nested_objects_and_leaves_explicit_openings() -> None:
    schema = {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"properties": {"t": {}}}},
            "pair": {"prefixItems": [{"properties": {"a": {}}}]},
            "either": {"anyOf": [{"properties": {"b": {}}}, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/R"},
            "free": {"type": "object"},
            "open": {"properties": {"c": {}}, "additionalProperties": True},
            "typed": {"properties": {"d": {}}, "additionalProperties": {"type": "integer"}},
            "both": {"allOf": [{"properties": {"e": {}}}, {"properties": {"f": {}}}]},
        },
        "$defs": {"R": {"properties": {"r": {}}}},
    }
    before = json.dumps(schema)
    closed = close_object_schemas(schema)
    assert json.dumps(schema) == before  # a copy: the request's own schema is unchanged
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["point"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["R"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # lists nothing: any object
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    # allOf parts stay open: closing each would refuse the other's properties.
    assert all("additionalProperties" not in part for part in props["both"]["allOf"])
    spec = StructuredOutput("json", json.dumps(close_object_schemas(WEATHER)))
    assert _accepts(spec, '{"city":"Oslo","days":2}')
    assert not _accepts(spec, '{"city":"Oslo","country":"NO"}')
    assert _accepts(StructuredOutput("json", json.dumps(WEATHER)), '{"city":"Oslo","country":"NO"}')


# ---------------------------------------------------------------- cut off by max_tokens


def _summary(parsed: ParsedDelta) -> tuple[str, list[tuple[str, str]]]:
    calls = parsed.tool_calls()
    return parsed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(
    ("make", "text", "calls"),
    [
        # a required call cut off before its name is whole: dropped
        (required_parser, '[{"name":"add","arguments":{}},{"', [("add", "{}")]),
        (required_parser, '[{"name":"add","arguments":{}},{"name":"get_we', [("add", "{}")]),
        (required_parser, "[", []),
        # ... after its name: a call with no arguments yet
        (required_parser, '[{"name":"get_weather","arguments":', [("get_weather", "")]),
        # ... inside its arguments: a call with what came
        (required_parser, '[{"name":"get_weather","arguments":{"ci', [("get_weather", '{"ci')]),
        # auto with a format (held by the grammar): a cut-off block is no content
        (
            lambda: make_parser("hermes", held=True),
            HERMES_CALL + "\n<tool_c",
            [("get_weather", '{"city":"Oslo"}')],
        ),
        (lambda: make_parser("hermes", held=True), '<tool_call>\n{"na', []),
        (lambda: make_parser("hermes", held=True), "<tool_", []),
        (
            lambda: make_parser("hermes", held=True),
            '<tool_call>\n{"name": "add", "arguments": {}}\n</tool',
            [("add", "{}")],
        ),
    ],
)
def test_a_cut_off_held_call_never_leaks_into_content(make, text, calls) -> None:
    assert _summary(make().parse(text)) == ("", calls)
    streamed = make()
    total = ParsedDelta()
    for char in text:  # fed a character at a time, as a stream may split it
        total.extend(streamed.feed(char))
    total.extend(streamed.finish())
    assert _summary(total) == ("", calls)


def test_a_cut_off_answer_keeps_its_text() -> None:
    text = '{"city":"a <'
    assert make_parser("hermes", held=True).parse(text).content == text


class LengthEngine(FakeEngine):
    """Answers every request with the tokens of a text, the last one finishing with
    "length" (``max_tokens`` reached)."""

    def __init__(self, stream: trio.abc.Stream, token_ids: list[int]) -> None:
        super().__init__(stream)
        self.token_ids = token_ids

    async def on_message(self, message: object) -> None:
        if isinstance(message, AddRequest):
            *head, last = self.token_ids
            for token in head:
                await self.server_side.send(
                    StepOutputs([RequestOutput(message.request_id, [token])], STATS)
                )
            done = RequestOutput(message.request_id, [last], "length")
            await self.server_side.send(StepOutputs([done], STATS))


async def _post(smol_tokenizer, body: dict[str, Any], text: str) -> httpx.Response:
    async with trio.open_nursery() as nursery:
        engine, stream = engine_client_pair(INFO)
        fake = LengthEngine(stream, smol_tokenizer.encode(text, add_special_tokens=False))
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        serving = ModelServing(engine, smol_tokenizer, ("m",), tool_call_parser="hermes")
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/chat/completions", json=body)
        nursery.cancel_scope.cancel()
    return response


async def test_a_required_call_cut_off_is_a_call_with_finish_reason_length(smol_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}
    text = '[{"name":"add","arguments":{}},{"'
    whole = await _post(smol_tokenizer, body, text)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]
    content, calls, finish = _streamed(await _post(smol_tokenizer, {**body, "stream": True}, text))
    assert (content, finish) == (None, "length")
    assert [c["function"]["name"] for c in calls] == ["add"]
