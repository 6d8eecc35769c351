"""Hostile and careless grammars without a model (issue 30): the size limits checked on a
spec's text before any grammar work, specs that no output could complete, llguidance's
messages as clients see them, the engine's pool of compile workers (cancelled, timed
out), and the API process's own checks, which a client that leaves abandons."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import trio
import trio.testing

from tests.support.asgi import json_post_scope
from tests.unit.conftest import FakeEngine, engine_client_pair
from trio_llm.api.anthropic.request import MessagesRequest
from trio_llm.api.app import build_app
from trio_llm.api.chat import generation_request
from trio_llm.api.chat.planner import SMALL_GRAMMAR_CHARS
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.serving import CLIENT_CLOSED_REQUEST, ModelServing
from trio_llm.api.http.errors import APIError
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.engine.grammar_compiler import GrammarCompiler
from trio_llm.messages import EngineReady, StructuredOutput
from trio_llm.structured_output import spec_limits
from trio_llm.structured_output.errors import SpecLimitError, StructuredOutputError, one_line
from trio_llm.structured_output.grammar_check import check_structured_output
from trio_llm.structured_output.spec_limits import (
    MAX_CHOICES,
    MAX_ENUM_VALUES,
    MAX_GRAMMAR_CHARS,
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    check_spec_limits,
)
from trio_llm.structured_output.unsatisfiable import unsatisfiable_reason

QUESTION = [{"role": "user", "content": "Which?"}]


def _schema(**fields: Any) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(fields))


def _object(num_properties: int, prefix: str = "p") -> dict[str, Any]:
    names = [f"{prefix}{i}" for i in range(num_properties)]
    return {"type": "object", "properties": {name: {"type": "integer"} for name in names}}


def _nested(depth: int) -> dict[str, Any]:
    """A schema whose document nests ``depth`` objects and lists (counting the root)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range((depth - 1) // 2):  # each level adds the schema and its properties map
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---------------------------------------------------------------- the limits, on the text


@pytest.mark.parametrize(
    ("spec", "figure"),
    [
        (StructuredOutput("choice", json.dumps(["x"] * (MAX_CHOICES + 1))), "4,097 choices"),
        (StructuredOutput("choice", json.dumps(["x" * MAX_SCHEMA_CHARS])), "characters"),
        (StructuredOutput("regex", "a" * (MAX_GRAMMAR_CHARS + 1)), "65,537 characters"),
        (StructuredOutput("grammar", 'start: "' + "a" * MAX_GRAMMAR_CHARS + '"'), "grammar"),
        (_schema(type="string", description="x" * MAX_SCHEMA_CHARS), "JSON Schema has"),
        (StructuredOutput("json", json.dumps(_object(MAX_OBJECT_PROPERTIES + 1))), "1,001"),
        (StructuredOutput("json", json.dumps(_nested(MAX_SCHEMA_DEPTH + 2))), "64 deep"),
        (_schema(enum=list(range(MAX_ENUM_VALUES + 1))), "4,096 enum values"),
        (
            _schema(
                type="object",
                properties={f"o{i}": _object(1000, f"o{i}_") for i in range(5)},
            ),
            "5,000 properties",
        ),
    ],
)
def test_a_spec_over_a_limit_is_refused_by_name_and_figure(
    spec: StructuredOutput, figure: str
) -> None:
    with pytest.raises(SpecLimitError, match="this server's limit") as raised:
        check_spec_limits(spec)
    assert figure in str(raised.value)


def test_specs_at_the_limits_pass_them() -> None:
    check_spec_limits(StructuredOutput("choice", json.dumps([str(i) for i in range(MAX_CHOICES)])))
    check_spec_limits(StructuredOutput("regex", "a" * MAX_GRAMMAR_CHARS))
    check_spec_limits(StructuredOutput("json", json.dumps(_object(MAX_OBJECT_PROPERTIES))))
    check_spec_limits(StructuredOutput("json", json.dumps(_nested(MAX_SCHEMA_DEPTH))))
    five = {f"o{i}": _object(999, f"o{i}_") for i in range(5)}  # 4,995 + 5 properties
    check_spec_limits(_schema(type="object", properties=five))
    check_spec_limits(_schema(enum=list(range(MAX_ENUM_VALUES))))
    # Deep nesting is measured without recursion (llguidance itself stops at 128).
    deep = '{"default": ' + "[" * 500 + "]" * 500 + "}"
    with pytest.raises(SpecLimitError, match="deep"):
        check_spec_limits(StructuredOutput("json", deep))


def _refused(body: dict[str, Any]) -> APIError:
    request = ChatCompletionRequest.model_validate(body)
    with pytest.raises(APIError) as raised:
        request.structured_output()
    return raised.value


@pytest.fixture
def no_grammar_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any grammar work from here on fails the test: limits come first."""

    def compile_nothing(*args: object, **kwargs: object) -> None:
        raise AssertionError("a grammar was built for a spec over the limits")

    monkeypatch.setattr(generation_request, "check_structured_output", compile_nothing)


HUGE_CHOICE = [f"choice number {i}" for i in range(100_000)]  # 2.1 MB, as issue 30's


@pytest.mark.usefixtures("no_grammar_work")
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_choice": HUGE_CHOICE}, "guided_choice"),
        ({"structured_outputs": {"choice": HUGE_CHOICE}}, "structured_outputs"),
        (
            {"structured_outputs": {"grammar": "start: " + " | ".join(['"a"'] * 20000)}},
            "structured_outputs",
        ),
        ({"guided_regex": "(a|b)" * 20000}, "guided_regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": _object(MAX_OBJECT_PROPERTIES + 1)},
                }
            },
            "response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(99)}}]},
            "tools",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": f"f{i}", "parameters": _object(300, f"f{i}_")},
                    }
                    for i in range(128)
                ]
            },
            "tools",
        ),
    ],
)
def test_the_api_refuses_an_oversized_spec_before_any_grammar_work(
    body: dict[str, Any], param: str
) -> None:
    error = _refused({"messages": QUESTION, **body})
    assert error.status == 400 and error.param == param
    assert error.message.startswith(param) and "this server's limit" in error.message


@pytest.mark.usefixtures("no_grammar_work")
def test_the_other_apis_name_their_own_fields() -> None:
    schema = _object(MAX_OBJECT_PROPERTIES + 1)
    anthropic = {
        "model": "m",
        "max_tokens": 8,
        "messages": QUESTION,
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
    }
    request = MessagesRequest.model_validate(anthropic)
    chat = request.to_chat()
    with pytest.raises(APIError) as raised:
        chat.structured_output()
    assert request.api_names(raised.value.param, raised.value.message)[0] == "output_config"
    responses = {
        "input": "Which?",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
    }
    request = ResponsesRequest.model_validate(responses)
    with pytest.raises(APIError) as raised:
        request.to_chat().structured_output()
    assert request.api_names(raised.value.param, raised.value.message)[0] == "text"


# ---------------------------------------------------------------- specs that match nothing

CYCLES = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    # Neither branch ends, and neither is forced (a model would pick one and go on forever).
    {
        "anyOf": [
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"$ref": "#"}}, "required": ["b"]},
        ]
    },
    # The root is fine ({} matches), but an output that starts "x" can never end.
    {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/a"}},
        "$defs": {
            "a": {
                "type": "object",
                "properties": {"y": {"$ref": "#/$defs/a"}},
                "required": ["y"],
            }
        },
    },
]

RECURSIVE_BUT_FINITE = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # {} ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    },
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: 1 matches
    {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "integer"}], "$defs": {"node": {"$ref": "#"}}},
    {"type": "object", "properties": {"a": False}},  # a must be absent: llguidance's matter
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/remote.json"}}},
]


@pytest.mark.parametrize("schema", CYCLES)
def test_a_schema_that_recurses_without_end_matches_nothing(schema: dict[str, Any]) -> None:
    assert "requires itself through $ref without end" in (unsatisfiable_reason(schema) or "")
    with pytest.raises(StructuredOutputError, match="matches no JSON value"):
        check_structured_output(StructuredOutput("json", json.dumps(schema)))


@pytest.mark.parametrize("schema", RECURSIVE_BUT_FINITE)
def test_a_recursive_schema_with_a_way_out_is_satisfiable(schema: dict[str, Any]) -> None:
    assert unsatisfiable_reason(schema) is None


@pytest.mark.parametrize("grammar", ["start: start", 'start: a\na: a "x"'])
def test_a_grammar_that_matches_nothing_is_refused(grammar: str) -> None:
    with pytest.raises(StructuredOutputError, match="matches no string"):
        check_structured_output(StructuredOutput("grammar", grammar))


def test_a_rule_wider_than_the_parser_is_refused_at_validation() -> None:
    """Some of llguidance's limits show only after the first byte: its parser holds at
    most 2,000 items in a row, so a rule of more alternatives compiles and fails at the
    output's first token. A one-byte step into the grammar finds them."""
    wide = "start: " + " | ".join(json.dumps(f"w{i}") for i in range(3000))
    with pytest.raises(StructuredOutputError, match="max is 2000") as raised:
        check_structured_output(StructuredOutput("grammar", wide))
    assert "\n" not in str(raised.value)
    # A forced chain without end shows there too, as llguidance's item limit.
    with pytest.raises(StructuredOutputError, match="Too many items"):
        check_structured_output(StructuredOutput("grammar", 'start: "{" start "}"'))
    # A choice list of as many strings is one lexeme, not a rule: it is served.
    choices = [f"w{i}" for i in range(MAX_CHOICES)]
    check_structured_output(StructuredOutput("choice", json.dumps(choices)))


def test_the_api_refuses_what_matches_nothing_naming_the_field() -> None:
    error = _refused({"messages": QUESTION, "structured_outputs": {"grammar": "start: start"}})
    assert error.param == "structured_outputs" and "matches no string" in error.message
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    error = _refused({"messages": QUESTION, "response_format": form})
    assert error.param == "response_format" and "matches no JSON value" in error.message
    cycle = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "loop", "parameters": cycle}}]
    for choice in ({"type": "function", "function": {"name": "loop"}}, "required", "auto"):
        error = _refused({"messages": QUESTION, "tools": tools, "tool_choice": choice})
        assert error.param == "tools" and "matches no JSON value" in error.message
        assert error.message.startswith("tools[0].function.parameters (loop)")


# ---------------------------------------------------------------- messages, one line each

PANIC = """panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10
<backtrace>
   0: <unknown>
  16: type_call
             at ./Python-3.11.7/Objects/typeobject.c:1091:11
</backtrace>"""

STATE_DUMP = """parser error: Too many items (limit 50000; ff_tokens)
<state>
Tokens: ⟦⟧
Parser: {
  "compute_time_us": 15,
</state>"""


def test_library_messages_keep_their_reason_and_lose_their_internals() -> None:
    assert one_line(PANIC) == (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"
    )
    assert one_line(STATE_DUMP) == "parser error: Too many items (limit 50000; ff_tokens)"
    assert one_line("Unknown format: foo\n<non-verbose/>") == "Unknown format: foo"
    with pytest.raises(StructuredOutputError) as raised:
        check_structured_output(StructuredOutput("grammar", "start: undefined_rule"))
    assert str(raised.value) == 'at 1(8): unknown name: "undefined_rule"'
    with pytest.raises(StructuredOutputError) as raised:
        check_structured_output(StructuredOutput("regex", "[a-z"))
    assert "\n" not in str(raised.value) and "unclosed character class" in str(raised.value)


# ---------------------------------------------------------------- the engine's compile pool


class _FakeBuilds:
    """A `GrammarCompiler` whose tokenizer is a stand-in and whose `build` waits for the
    test: each build announces itself, then waits for `release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **options: Any) -> None:
        self.compiler = GrammarCompiler("/nowhere", 10, frozenset({2}), **options)
        self.release = threading.Event()
        self.started: list[str] = []
        self.entered = threading.Semaphore(0)
        self.barrier: threading.Barrier | None = None
        self.events = threading.Semaphore(0)
        self.compiler.on_event = self.events.release
        monkeypatch.setattr(self.compiler, "_build_tokenizer", lambda: "tokenizer")
        monkeypatch.setattr(self.compiler, "build", self._build)

    def _build(self, spec: StructuredOutput) -> str:
        self.started.append(spec.spec)
        self.entered.release()
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # every worker is in a build at once
        assert self.release.wait(timeout=60), "the test never released the builds"
        return f"matcher of {spec.spec}"

    def close(self) -> None:
        self.release.set()
        self.compiler.close()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[_FakeBuilds] = []

    def make(**options: Any) -> _FakeBuilds:
        made.append(_FakeBuilds(monkeypatch, **options))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def _regex(text: str) -> StructuredOutput:
    return StructuredOutput("regex", text)


def test_compiles_run_side_by_side_on_the_pools_workers(builds: Any) -> None:
    fake = builds(num_workers=2)
    fake.barrier = threading.Barrier(2)
    first, second = fake.compiler.compile(_regex("a")), fake.compiler.compile(_regex("b"))
    assert fake.entered.acquire(timeout=30) and fake.entered.acquire(timeout=30)
    fake.release.set()
    assert first.future.result(timeout=30) == "matcher of a"
    assert second.future.result(timeout=30) == "matcher of b"


def test_a_queued_compile_nobody_waits_for_is_cancelled_and_forgotten(builds: Any) -> None:
    fake = builds(num_workers=1)
    running = fake.compiler.compile(_regex("running"))
    assert fake.entered.acquire(timeout=30)
    queued = fake.compiler.compile(_regex("queued"))
    shared = fake.compiler.compile(_regex("queued"))  # a second request, same grammar
    assert shared is queued and queued.waiters == 2
    fake.compiler.release(queued)
    assert not queued.future.cancelled()  # one request still waits
    fake.compiler.release(queued)
    assert queued.future.cancelled() and queued.ready()
    fake.compiler.release(running)  # under way: it runs to its end, for the cache
    assert not running.future.cancelled()
    fake.release.set()
    assert running.future.result(timeout=30) == "matcher of running"
    again = fake.compiler.compile(_regex("queued"))
    assert again is not queued  # asked for anew: compiled anew
    assert again.future.result(timeout=30) == "matcher of queued"
    assert fake.started == ["running", "queued"]
    assert fake.compiler.compile(_regex("running")) is running  # cached


def test_a_compile_past_its_time_limit_is_ready_to_fail_its_requests(builds: Any) -> None:
    fake = builds(num_workers=1, timeout=0.05)
    job = fake.compiler.compile(_regex("slow"))
    assert fake.entered.acquire(timeout=30)
    while not job.timed_out:  # on_event is called at the start and at the timeout
        assert fake.events.acquire(timeout=30)
    assert job.ready() and not job.done() and job.started is not None
    fake.release.set()
    assert job.future.result(timeout=30) == "matcher of slow"  # cached when it ends


def test_a_failed_build_is_one_line_and_stays_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = GrammarCompiler("/nowhere", 10, frozenset({2}), num_workers=1)
    monkeypatch.setattr(compiler, "_build_tokenizer", lambda: "tokenizer")
    calls: list[str] = []

    def fail(spec: StructuredOutput) -> None:
        calls.append(spec.spec)
        raise RuntimeError(PANIC)

    monkeypatch.setattr(compiler, "build", fail)
    try:
        job = compiler.compile(_regex("x"))
        with pytest.raises(StructuredOutputError) as raised:
            job.future.result(timeout=30)
        assert "backtrace" not in str(raised.value) and "\n" not in str(raised.value)
        assert compiler.compile(_regex("x")) is job and calls == ["x"]
    finally:
        compiler.close()


# ---------------------------------------------------------------- the API process's checks

INFO = EngineReady("/model", 4096, 256, 16, [2], 49152, "float32", 1)


#: A regex large enough to wait for its turn among the grammar checks.
LARGE = "x" * (SMALL_GRAMMAR_CHARS + 1)


async def test_a_client_that_leaves_abandons_its_grammar_check(
    smol_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large spec's grammar is checked in a worker thread, one at a time here: its
    client leaves while the check runs, a second one while it waits for its turn, and
    both answers come at once; the waiting check never starts. A small spec is checked
    meanwhile without waiting for its turn."""
    entered = threading.Event()
    small_checked = threading.Event()
    release = threading.Event()
    checked: list[str] = []

    def slow_check(spec: StructuredOutput, tokenizer: object = None) -> str:
        checked.append(spec.spec[:6])
        if len(spec.spec) <= SMALL_GRAMMAR_CHARS:
            small_checked.set()
            return ""
        entered.set()
        release.wait(timeout=20)
        return ""

    monkeypatch.setattr(generation_request, "check_structured_output", slow_check)
    try:
        async with trio.open_nursery() as nursery:
            engine, stream = engine_client_pair(INFO)
            nursery.start_soon(engine.route_outputs)
            nursery.start_soon(FakeEngine(stream).run)
            serving = ModelServing(engine, smol_tokenizer, ("m",))
            serving.planner.grammar_checks = trio.CapacityLimiter(1)
            app = build_app(serving, lambda: True)
            first = _Client(app, {"messages": QUESTION, "guided_regex": "first" + LARGE})
            second = _Client(app, {"messages": QUESTION, "guided_regex": "secnd" + LARGE})
            small = _Client(app, {"messages": QUESTION, "guided_regex": "small"})
            nursery.start_soon(first.run)
            await trio.to_thread.run_sync(entered.wait)
            nursery.start_soon(second.run)
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(10):  # (a safety net: today's server answers at once)
                nursery.start_soon(small.run)
                await trio.to_thread.run_sync(small_checked.wait, abandon_on_cancel=True)
                for client in (first, second, small):
                    client.leave()
                    await client.answered.wait()
            nursery.cancel_scope.cancel()
    finally:
        release.set()
    assert first.status == second.status == small.status == CLIENT_CLOSED_REQUEST
    assert checked == ["firstx", "small"]


class _Client:
    """One POST /v1/chat/completions through the ASGI app, whose client can leave."""

    def __init__(self, app: Any, body: dict[str, Any]) -> None:
        self.app = app
        self.body = json.dumps({"model": "m", **body}).encode()
        self.left = trio.Event()
        self.answered = trio.Event()
        self.status: int | None = None
        self._sent_body = False

    def leave(self) -> None:
        self.left.set()

    async def run(self) -> None:
        scope = json_post_scope("/v1/chat/completions")
        await self.app(scope, self._receive, self._send)
        self.answered.set()

    async def _receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


def test_the_limits_module_imports_no_grammar_library() -> None:
    """The cheap checks cost no llguidance import (a test of the module's promise)."""
    assert "llguidance" not in spec_limits.__dict__
