"""Constrained decoding in the engine (`SamplingParams.structured_output`): an in-process
`EngineCore` on the tiny random model with SmolLM2's tokenizer. A random model is the
hardest client: whatever it would say, every finished output must be valid."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.support.tool_schemas import closed_object
from trio_llm import open_engine
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, SamplingParams, StructuredOutput
from trio_llm.model_files.loader import load_model

#: Runs an engine core in this process: the slow tier.
pytestmark = pytest.mark.slow

PROMPT = [1, 2, 3, 4, 5]
#: Samples per spec here; tests/unit/structured_output/test_structured_sampling.py takes 50
#: of each schema.
SAMPLES = 12

SCHEMAS = [
    closed_object(
        name={"type": "string", "maxLength": 8},
        age={"type": "integer", "minimum": 0, "maximum": 120},
    ),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    {"type": "string", "pattern": "^[a-f0-9]{4}$"},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    {"type": "boolean"},
    {"const": "fixed"},
]


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> EngineCore:
    model = load_model(tiny_model_dir, "float32", "sdpa")
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), max_model_len=512),
        cache=CacheConfig(num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
    )
    return EngineCore(model, config, str(tiny_model_dir))


def _run(core: EngineCore, requests: dict[str, SamplingParams]) -> dict[str, dict]:
    """Every request at once; per request its tokens, finish_reason, error, logprobs."""
    results: dict[str, dict] = {}
    for request_id, params in requests.items():
        rejected = core.add_request(AddRequest(request_id, PROMPT, params))
        results[request_id] = {"tokens": [], "logprobs": [], "finish": None, "error": None}
        if rejected is not None:
            results[request_id].update(finish=rejected.finish_reason, error=rejected.error)
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            result = results[output.request_id]
            result["tokens"] += output.new_token_ids
            result["logprobs"] += output.logprobs or []
            if output.finish_reason is not None:
                result["finish"], result["error"] = output.finish_reason, output.error
    return results


def _params(kind: str, spec: str = "", seed: int = 0, **fields: object) -> SamplingParams:
    fields.setdefault("max_tokens", 64)
    return SamplingParams(
        temperature=1.0, seed=seed, structured_output=StructuredOutput(kind, spec), **fields
    )


def test_regex_choice_and_grammar(core: EngineCore, smol_tokenizer) -> None:
    regex = r"[a-z]{2,5}-[0-9]{2}"
    choices = ["yes", "no", "not sure"]
    grammar = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'
    requests = {}
    for n in range(SAMPLES):
        requests[f"regex-{n}"] = _params("regex", regex, seed=n)
        requests[f"choice-{n}"] = _params("choice", json.dumps(choices), seed=n)
        requests[f"grammar-{n}"] = _params("grammar", grammar, seed=n)
    results = _run(core, requests)
    for request_id, result in results.items():
        text = smol_tokenizer.decode(result["tokens"])
        kind = request_id.split("-")[0]
        if kind == "regex":
            assert result["finish"] == "stop" and re.fullmatch(regex, text), text
        elif kind == "choice":
            assert result["finish"] == "stop" and text in choices, text
        else:
            assert result["finish"] == "stop", result
            assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text


def test_a_constrained_output_cut_by_max_tokens_ends_with_length(core: EngineCore) -> None:
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 50}
    results = _run(core, {"cut": _params("json", json.dumps(schema), max_tokens=5)})
    assert results["cut"]["finish"] == "length" and len(results["cut"]["tokens"]) == 5


def test_logprobs_describe_the_masked_distribution(core: EngineCore, smol_tokenizer) -> None:
    choices = ["yes", "no"]
    params = _params("choice", json.dumps(choices), logprobs=20)
    entry = _run(core, {"lp": params})["lp"]["logprobs"][0]

    def allowed(token: int) -> bool:  # the token starts one of the choices
        text = smol_tokenizer.decode([token])
        return bool(text) and any(choice.startswith(text) for choice in choices)

    assert allowed(entry.token_id) and entry.logprob > -1e30
    pairs = zip(entry.top_token_ids, entry.top_logprobs, strict=True)
    finite = [token for token, logprob in pairs if logprob > -1e30]
    assert finite and all(allowed(token) for token in finite)
    # Some of the 20 best are outside the mask: they are reported with -inf.
    assert len(finite) < len(entry.top_token_ids)


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json", json.dumps({"type": "array", "uniqueItems": True}), "uniqueItems"),
        ("json", json.dumps({"not": {"type": "string"}}), "not"),
        ("json", json.dumps({"type": "strng"}), "strng"),
        ("json", "{not json", "structured_output"),
        ("regex", "[a-z", "structured_output"),
        ("choice", "[]", "non-empty list"),
        ("grammar", "start: undefined_rule", "structured_output"),
    ],
)
def test_what_cannot_be_enforced_is_refused_with_the_reason(
    core: EngineCore, kind: str, spec: str, reason: str
) -> None:
    result = _run(core, {"bad": _params(kind, spec)})["bad"]
    assert result["finish"] == "abort" and result["tokens"] == []
    assert result["error"].startswith("structured_output: ") and reason in result["error"]


@pytest.mark.parametrize("mode", ["inline", "process"])
async def test_the_embedding_api_streams_the_whole_constrained_text(
    tiny_model_dir: Path, mode: str
) -> None:
    """Through the real engine process (and the detokenizer child): the text ends with
    the grammar's last token, which is content, not a stop token."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    spec = StructuredOutput("json", json.dumps(schema))
    args = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
    async with open_engine(tiny_model_dir, detokenizer_mode=mode, **args) as engine:
        for seed in range(3):
            params = SamplingParams(max_tokens=64, seed=seed, structured_output=spec)
            async with engine.generate("Where?", params) as generation:
                outputs = [output async for output in generation]
            text = "".join(output.text for output in outputs)
            assert outputs[-1].finish_reason == "stop"
            ids = [token for output in outputs for token in output.token_ids]
            assert text == engine.tokenizer.decode(ids)
            jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------ compiling in a worker thread


class _HeldCompiles:
    """Wraps ``core.grammars.build`` so that each compile waits for `release` (a test
    hook): what the engine does meanwhile is observable step by step."""

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.specs: list[StructuredOutput] = []
        self.threads: set[str] = set()
        build = core.grammars.build

        def held_build(spec: StructuredOutput) -> object:
            self.specs.append(spec)
            self.threads.add(threading.current_thread().name)
            self.started.set()
            # A safety net only: the test sets the event long before.
            assert self.release.wait(timeout=120), "the test never released the compile"
            return build(spec)

        monkeypatch.setattr(core.grammars, "build", held_build)


@pytest.fixture
def held(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> Iterator[_HeldCompiles]:
    """Compiles of the module's core held until the test releases them (at the latest,
    when it ends)."""
    compiles = _HeldCompiles(core, monkeypatch)
    yield compiles
    compiles.release.set()


def _drain(core: EngineCore) -> dict[str, dict]:
    """Step until every request finished; per request its tokens, finish_reason, error."""
    results: dict[str, dict] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            result = results.setdefault(
                output.request_id, {"tokens": [], "finish": None, "error": None}
            )
            result["tokens"] += output.new_token_ids
            if output.finish_reason is not None:
                result["finish"], result["error"] = output.finish_reason, output.error
    return results


def _num_waiting_for_grammar(core: EngineCore) -> int:
    """Requests whose grammar is still compiling (or compiled but not collected by a step)."""
    return sum(request.waits_for_grammar for request in core.scheduler.waiting)


def _waiting(core: EngineCore, request_id: str):
    return next(r for r in core.scheduler.waiting if r.request_id == request_id)


def _new_schema(salt: str) -> dict:
    """A schema no other test compiled (so it is not in the module core's cache)."""
    return {
        "type": "object",
        "properties": {salt: {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": [salt],
        "additionalProperties": False,
    }


def test_a_new_grammar_compiles_while_running_requests_keep_decoding(
    core: EngineCore, smol_tokenizer, held: _HeldCompiles
) -> None:
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert core.add_request(AddRequest("plain", PROMPT, plain)) is None
    first = core.step().outputs  # prefill: the first token
    assert [(o.request_id, len(o.new_token_ids)) for o in first] == [("plain", 1)]

    schema = _new_schema("compiled_in_a_thread")
    constrained = _params("json", json.dumps(schema), seed=1)
    assert core.add_request(AddRequest("constrained", PROMPT, constrained)) is None
    same = _params("json", json.dumps(schema))
    assert core.add_request(AddRequest("same", PROMPT, same)) is None
    assert held.started.wait(timeout=120)
    waiting = _waiting(core, "constrained")
    for _ in range(5):  # the compile is held: the running request gets a token every step
        outputs = core.step().outputs
        assert [(o.request_id, len(o.new_token_ids)) for o in outputs] == [("plain", 1)]
        assert waiting.waits_for_grammar and waiting.block_table == []
        assert _num_waiting_for_grammar(core) == 2
    assert held.threads and threading.current_thread().name not in held.threads

    held.release.set()
    results = _drain(core)
    assert results["plain"]["finish"] == "length" and len(results["plain"]["tokens"]) == 10
    for request_id in ("constrained", "same"):
        result = results[request_id]
        assert result["finish"] == "stop", result
        jsonschema.validate(json.loads(smol_tokenizer.decode(result["tokens"])), schema)
    assert len(held.specs) == 1  # one compile for both requests

    # Cached: the next request with that schema does not wait at all.
    assert core.add_request(AddRequest("again", PROMPT, constrained)) is None
    assert _num_waiting_for_grammar(core) == 0
    assert _drain(core)["again"]["finish"] == "stop" and len(held.specs) == 1


def test_a_grammar_that_fails_to_compile_ends_only_its_request(
    core: EngineCore, held: _HeldCompiles
) -> None:
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert core.add_request(AddRequest("plain", PROMPT, plain)) is None
    core.step()
    bad = json.dumps({"type": "array", "uniqueItems": True, "maxItems": 7})
    assert core.add_request(AddRequest("bad", PROMPT, _params("json", bad))) is None
    assert held.started.wait(timeout=120)
    outputs = core.step().outputs
    assert [o.request_id for o in outputs] == ["plain"]
    held.release.set()
    results = _drain(core)
    assert results["bad"]["finish"] == "abort" and results["bad"]["tokens"] == []
    assert results["bad"]["error"].startswith("structured_output: ")
    assert "uniqueItems" in results["bad"]["error"]
    assert results["plain"]["finish"] == "length" and len(results["plain"]["tokens"]) == 6
    assert "bad" not in core.scheduler and _num_waiting_for_grammar(core) == 0


def test_aborting_a_request_while_its_grammar_compiles(
    core: EngineCore, held: _HeldCompiles
) -> None:
    spec = _params("json", json.dumps(_new_schema("aborted_while_compiling")))
    assert core.add_request(AddRequest("gone", PROMPT, spec)) is None
    assert held.started.wait(timeout=120)
    assert not core.has_work()  # only a request waiting for its grammar: nothing to step
    core.abort(["gone"])
    assert "gone" not in core.scheduler and _num_waiting_for_grammar(core) == 0
    assert not core.has_unfinished_requests()
    held.release.set()
    # The compile goes on for the cache; the aborted request never produces an output.
    core.grammars.compile(spec.structured_output).future.result(timeout=120)
    assert not core.has_work() and core.step().outputs == []
    assert core.add_request(AddRequest("gone", PROMPT, spec)) is None  # the id is free
    assert _num_waiting_for_grammar(core) == 0  # compiled once, cached
    assert _drain(core)["gone"]["finish"] == "stop" and len(held.specs) == 1


# ------------------------------------------------------------ hostile grammars (issue 30)
# A grammar that matches nothing, or that fails while a mask is computed, ends its request
# with an error (never finish_reason "stop" on an unfinished grammar); a compile past its
# time limit fails its requests; a queued compile every request left is never run.


def test_a_grammar_that_matches_nothing_fails_its_request(core: EngineCore) -> None:
    for request_id, spec in {
        "loop": _params("grammar", "start: start"),
        "self": _params("json", json.dumps({"$ref": "#"})),
        "cycle": _params(
            "json",
            json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        ),
    }.items():
        rejected = core.add_request(AddRequest(request_id, PROMPT, spec))
        if rejected is None:  # compiled in the worker: the next step says
            result = _drain(core)[request_id]
            finish, error, tokens = result["finish"], result["error"], result["tokens"]
        else:
            finish, error, tokens = rejected.finish_reason, rejected.error, []
        assert finish == "abort" and tokens == [], (request_id, finish, tokens)
        assert error.startswith("structured_output: ") and "matches no" in error


def test_a_choice_of_thousands_of_strings_is_served(core: EngineCore, smol_tokenizer) -> None:
    choices = [f"label number {i}" for i in range(3000)]  # past llguidance's 2,000 per row
    source = json.dumps(choices)
    requests = {f"c{n}": _params("choice", source, seed=n, max_tokens=16) for n in range(3)}
    for result in _run(core, requests).values():
        assert result["finish"] == "stop", result
        assert smol_tokenizer.decode(result["tokens"]) in choices


def test_a_matcher_that_fails_mid_output_is_an_error_not_a_stop(core: EngineCore) -> None:
    """Every output of this grammar is infinitely deep, and llguidance finds out only once
    it has forced a few braces (its item limit, while the mask is computed); the matcher
    then allows only EOS, which must not read as a completed grammar."""
    spec = _params("grammar", 'start: "{" start "}"', max_tokens=32)
    assert core.add_request(AddRequest("nested", PROMPT, spec)) is None
    result = _drain(core)["nested"]
    assert result["finish"] == "abort", result
    error = result["error"]
    assert error.startswith("structured output: ") and "\n" not in error
    assert "<" not in error  # no <state> dump, no <non-verbose/> marker


def test_a_compile_past_its_time_limit_fails_its_requests(
    core: EngineCore, held: _HeldCompiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = threading.Semaphore(0)
    monkeypatch.setattr(core.grammars, "timeout", 0.05)
    monkeypatch.setattr(core, "on_grammar_event", events.release)
    spec = _params("json", json.dumps(_new_schema("past_its_time_limit")))
    assert core.add_request(AddRequest("slow", PROMPT, spec)) is None
    assert core.add_request(AddRequest("same", PROMPT, spec)) is None
    assert held.started.wait(timeout=120)
    while not core.has_work():  # woken at the compile's start, then at its time limit
        assert events.acquire(timeout=30), "no word of the compile's time limit"
    outputs = {o.request_id: o for o in core.step().outputs}
    for request_id in ("slow", "same"):
        assert outputs[request_id].finish_reason == "abort"
        assert "did not compile within 0.05 s" in outputs[request_id].error
    assert not core.has_unfinished_requests()
    held.release.set()  # the compile ends after all; its grammar is cached
    job = core.grammars.compile(spec.structured_output)
    job.future.result(timeout=120)
    core.grammars.release(job)
    assert core.add_request(AddRequest("later", PROMPT, spec)) is None
    assert _num_waiting_for_grammar(core) == 0
    assert _drain(core)["later"]["finish"] == "stop"


def test_aborting_the_requests_of_a_queued_compile_cancels_it(
    core: EngineCore, held: _HeldCompiles
) -> None:
    if core.grammars.num_workers != 1:
        pytest.skip("needs a queue: one compile worker (a machine of 1 or 2 cores)")
    running = _params("json", json.dumps(_new_schema("runs_first")))
    queued = _params("json", json.dumps(_new_schema("never_runs")))
    assert core.add_request(AddRequest("running", PROMPT, running)) is None
    assert held.started.wait(timeout=120)
    assert core.add_request(AddRequest("queued", PROMPT, queued)) is None
    job = next(r for r in core.scheduler.waiting if r.request_id == "queued").grammar
    core.abort(["queued"])
    assert job.future.cancelled()
    held.release.set()
    assert _drain(core)["running"]["finish"] == "stop"
    assert [spec.spec for spec in held.specs] == [running.structured_output.spec]
