"""Fuzz the HTTP API of a real server from its own OpenAPI schema (schemathesis).

Opt-in: skipped unless ``TRIO_LLM_FUZZ=1``, so a plain ``pytest`` / ``make test`` skips it
at collection speed. The test is marked ``fuzz`` (``-m fuzz`` / ``-m "not fuzz"``)::

    TRIO_LLM_FUZZ=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/fuzz -s

What it does: starts ``trio-llm serve`` (a real subprocess, `ServerProcess`) with a small
context, loads ``/openapi.json`` from it, and for every operation (``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``, ``/v1/embeddings``,
``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``,
``/version``, ``/metrics``) sends schemathesis' generated requests in both of its modes:
*positive* (bodies that fit the schema) and *negative* (bodies that violate it: wrong types,
out-of-range values, missing fields, bytes that are not JSON). One request at a time, each
with a timeout. The served schema declares the bodies of ``/tokenize`` and ``/detokenize``
as any JSON object (the routes validate by hand), so the test swaps in the pydantic schemas
of `TokenizeRequest` / `DetokenizeRequest` to reach past the first check.

The property, over at least 500 requests:

- no 5xx, no transport error, no timeout;
- every 4xx carries ``{"error": {"message", "type", "param", "code"}}``, and its ``param``
  is null or names a field of that request (declared by the route, or sent); on
  ``/v1/messages``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``;
- every 200 event stream is well formed JSON events ending with ``data: [DONE]`` (named
  events ending with ``message_stop`` or ``response.completed`` / ``.incomplete`` on
  ``/v1/messages`` and ``/v1/responses``) and carries no error event (an error after the
  200 would be a hidden 5xx);
- afterwards a normal completion and chat completion succeed, ``/health`` is 200, and
  SIGINT stops the server with exit status 0 and no engine process left.

The request count, the status histogram (overall and per operation) and the run time are
printed even without ``-s``; every failure is listed with its exact request (a curl line).

Knobs (environment):

- ``TRIO_LLM_FUZZ_EXAMPLES``: examples per operation and mode (default 100);
- ``TRIO_LLM_FUZZ_MIN_REQUESTS``: requests the run must reach (default 500);
- ``TRIO_LLM_FUZZ_SEED``: Hypothesis seed (default: random; printed for replay);
- ``TRIO_LLM_FUZZ_TIMEOUT``: seconds per request (default 60);
- ``TRIO_LLM_FUZZ_MODEL``: ``tiny`` (default: a 2-layer random Llama with SmolLM2's
  tokenizer, so a request for the whole context takes about a second even on 2 busy cores;
  every route, the scheduler, the sampler and the detokenizer run as in production) or
  ``real`` (SmolLM2-135M-Instruct; several seconds per long generation on a small CPU).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.procfs import engine_children, is_running
from tests.support.server_process import ServerProcess

FUZZ_ENV = "TRIO_LLM_FUZZ"

pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.skipif(
        os.environ.get(FUZZ_ENV) != "1", reason=f"opt-in fuzz test: set {FUZZ_ENV}=1 to run"
    ),
]

EXAMPLES = int(os.environ.get("TRIO_LLM_FUZZ_EXAMPLES", "100"))
MIN_REQUESTS = int(os.environ.get("TRIO_LLM_FUZZ_MIN_REQUESTS", "500"))
TIMEOUT_S = float(os.environ.get("TRIO_LLM_FUZZ_TIMEOUT", "60"))
MODEL_KIND = os.environ.get("TRIO_LLM_FUZZ_MODEL", "tiny")
MAX_MODEL_LEN = 128
ERROR_FIELDS = ("message", "type", "param", "code")


def _seed() -> int:
    """The Hypothesis seed: ``$TRIO_LLM_FUZZ_SEED`` or a fresh random one."""
    text = os.environ.get("TRIO_LLM_FUZZ_SEED")
    return int(text) if text else random.SystemRandom().randrange(2**32)


@dataclass
class Failure:
    """Requests that broke the property in one way on one operation."""

    detail: str  # what the server answered, for the shortest request
    request: str  # the shortest such request, as a curl line
    count: int = 0


@dataclass
class FuzzStats:
    """Requests sent, statuses seen and failures found during the fuzz run."""

    seed: int
    statuses: Counter[str] = field(default_factory=Counter)
    by_operation: dict[str, Counter[str]] = field(default_factory=dict, repr=False)
    refused_params: dict[str, Counter[str]] = field(default_factory=dict, repr=False)
    failures: dict[tuple[str, str], Failure] = field(default_factory=dict, repr=False)
    skipped: list[str] = field(default_factory=list, repr=False)
    started: float = field(default_factory=time.monotonic)
    request_seconds: float = 0.0

    @property
    def total(self) -> int:
        """Requests sent (answered or not)."""
        return sum(self.statuses.values())

    def record(self, label: str, outcome: str) -> None:
        """Count one request of operation ``label`` that ended in ``outcome`` (a status)."""
        self.statuses[outcome] += 1
        self.by_operation.setdefault(label, Counter())[outcome] += 1

    def record_failure(self, label: str, kind: str, detail: str, request: str) -> None:
        """Count a request of ``label`` that broke the property as ``kind``; keep the
        shortest such request (the run does not shrink: it keeps going instead)."""
        failure = self.failures.setdefault((label, kind), Failure(detail, request))
        failure.count += 1
        if len(request) < len(failure.request):
            failure.detail, failure.request = detail, request

    def record_refusal(self, label: str, content: bytes) -> None:
        """Count the ``error.param`` of a 4xx body (which check refused the request)."""
        try:
            param = str(json.loads(content)["error"]["param"])
        except (ValueError, KeyError, TypeError):
            param = "?"
        self.refused_params.setdefault(label, Counter())[param] += 1

    def report(self) -> str:
        """The figures as text: totals, histogram, per-operation histogram, failures."""
        elapsed = time.monotonic() - self.started
        lines = [
            f"fuzz: {self.total} requests in {elapsed:.1f} s ({self.request_seconds:.1f} s "
            f"waiting for responses; seed {self.seed}, {EXAMPLES} examples per operation "
            f"and mode, model {MODEL_KIND})",
            "status histogram: " + _histogram(self.statuses),
        ]
        for label, counts in sorted(self.by_operation.items()):
            lines.append(f"  {label}: {sum(counts.values())} requests, {_histogram(counts)}")
            refused = self.refused_params.get(label)
            if refused:
                top = ", ".join(f"{param}: {n}" for param, n in refused.most_common(12))
                lines.append(f"    4xx by error.param: {top}")
        lines += [f"skipped: {note}" for note in self.skipped]
        count = sum(failure.count for failure in self.failures.values())
        lines.append(f"failures: {count} requests, {len(self.failures)} kinds")
        for (label, kind), failure in sorted(self.failures.items()):
            lines += [
                f"--- {failure.count} x {label}: {kind}",
                f"answer: {failure.detail}",
                f"shortest request: {failure.request}",
            ]
        return "\n".join(lines)


def _histogram(counts: Counter[str]) -> str:
    return ", ".join(f"{key}: {counts[key]}" for key in sorted(counts))


@pytest.fixture(scope="session")
def fuzz_stats() -> FuzzStats:
    """The session's request counter and failure list."""
    return FuzzStats(seed=_seed())


@pytest.fixture(scope="module")
def fuzz_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A real ``trio-llm serve`` with a small context; must exit 0 on SIGINT afterwards."""
    if MODEL_KIND == "real":
        request.getfixturevalue("real_model_dir")  # converts the GGUF once, before the clock
        model_args: list[str] = []
    elif MODEL_KIND == "tiny":
        model_args = ["--model", str(request.getfixturevalue("tiny_model_dir"))]
    else:
        raise pytest.UsageError(f"TRIO_LLM_FUZZ_MODEL must be tiny or real, not {MODEL_KIND!r}")
    log = tmp_path_factory.mktemp("fuzz-server") / "server.log"
    args = [*model_args, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    server = ServerProcess(args, log_path=log, env={"TRIO_LLM_API_KEY": ""})
    with server:
        engines = engine_children(server.pid)
        yield server
    assert server.process is not None
    assert server.process.returncode == 0, server.log()
    assert not [pid for pid in engines if is_running(pid)], "engine process left behind"


def _load_schema(base_url: str) -> dict[str, Any]:
    """``/openapi.json`` from the server, with the hand-validated bodies described."""
    import httpx

    from trio_llm.api.tokenize_routes import DetokenizeRequest, TokenizeRequest

    response = httpx.get(f"{base_url}/openapi.json", timeout=30)
    assert response.status_code == 200, "the server does not serve /openapi.json"
    schema = response.json()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in body.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components[model.__name__] = body
        content = schema["paths"][path]["post"]["requestBody"]["content"]
        content["application/json"]["schema"] = {"$ref": f"#/components/schemas/{model.__name__}"}
    return schema


def _describe(case: Any, base_url: str) -> str:
    """The exact request, as a curl command line (or its parts if curl cannot say it)."""
    try:
        return case.as_curl_command(base_url=base_url)
    except Exception:  # schemathesis cannot render every generated body as curl
        return f"{case.method} {base_url}{case.formatted_path} body={case.body!r}"


def _body_fields(schema: dict[str, Any]) -> dict[str, set[str]]:
    """Fields each operation declares, by label (``POST /tokenize``): the top-level
    request-body fields plus the path and query parameters."""
    components = schema.get("components", {}).get("schemas", {})
    fields = {}
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            content = operation.get("requestBody", {}).get("content", {})
            body = content.get("application/json", {}).get("schema", {})
            if "$ref" in body:
                body = components[body["$ref"].rsplit("/", 1)[-1]]
            parameters = {p["name"] for p in operation.get("parameters", []) if "name" in p}
            fields[f"{method.upper()} {path}"] = set(body.get("properties", {})) | parameters
    return fields


Problem = tuple[str, str]  # (kind, detail): what broke the property, and the evidence


def _error_body_problem(content: bytes, fields: set[str], label: str = "") -> Problem | None:
    """Why ``content`` is not an OpenAI error body whose ``param`` is one of ``fields``
    (for ``/v1/messages``: not Anthropic's error body)."""
    try:
        body = json.loads(content)
    except ValueError:
        return "4xx body is not JSON", repr(content[:300])
    error = body.get("error") if isinstance(body, dict) else None
    detail = f"{body!r:.500}"
    if label.endswith(" /v1/messages"):
        if body.get("type") != "error" or not isinstance(error, dict):
            return "4xx body is not Anthropic's {'type': 'error', 'error': {...}}", detail
        if not all(isinstance(error.get(key), str) and error[key] for key in ("type", "message")):
            return "4xx Anthropic error.type / error.message is not a non-empty string", detail
        return None
    if not isinstance(error, dict) or not set(ERROR_FIELDS) <= error.keys():
        return f"4xx body is not {{'error': {{{', '.join(ERROR_FIELDS)}}}}}", detail
    if not (isinstance(error["message"], str) and error["message"]):
        return "4xx error.message is not a non-empty string", detail
    if not (isinstance(error["type"], str) and error["type"]):
        return "4xx error.type is not a non-empty string", detail
    if not all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")):
        return "4xx error.param / error.code is neither a string nor null", detail
    if error["param"] is not None and error["param"] not in fields:
        return f"4xx error.param {error['param']!r} names no field of the request", detail
    return None


#: The last event of a stream whose events are named (no ``[DONE]`` there), by route.
LAST_NAMED_EVENT = {
    "/v1/messages": ("message_stop",),
    "/v1/responses": ("response.completed", "response.incomplete"),
}


def _named_event_stream_problem(content: bytes, last: tuple[str, ...]) -> Problem | None:
    """Why a stream of named events (Anthropic Messages, Responses) is broken: an event
    whose data is not JSON or not of its name's type, an error event, or a last event
    other than ``last``."""
    lines = content.splitlines()
    names = [
        line.removeprefix(b"event: ").decode() for line in lines if line.startswith(b"event: ")
    ]
    datas = [line.removeprefix(b"data: ").decode() for line in lines if line.startswith(b"data: ")]
    if not names or len(names) != len(datas) or names[-1] not in last:
        return f"200 named event stream does not end with {' or '.join(last)}", repr(content[-300:])
    for name, data in zip(names, datas, strict=True):
        try:
            event = json.loads(data)
        except ValueError:
            return "200 event stream has an event that is not JSON", data[:300]
        if name == "error" or not isinstance(event, dict) or event.get("type") != name:
            return "error or misnamed event inside a 200 event stream", data[:500]
    return None


def _event_stream_problem(content: bytes, label: str = "") -> Problem | None:
    """Why a 200 event stream is broken (bad JSON, an error event, no [DONE]), or None."""
    last = LAST_NAMED_EVENT.get(label.partition(" ")[2])
    if last is not None:
        return _named_event_stream_problem(content, last)
    events = [
        line.removeprefix(b"data: ").decode()
        for line in content.splitlines()
        if line.startswith(b"data: ")
    ]
    if not events or events[-1] != "[DONE]":
        return "200 event stream does not end with [DONE]", repr(content[-300:])
    for data in events[:-1]:
        try:
            event = json.loads(data)
        except ValueError:
            return "200 event stream has an event that is not JSON", data[:300]
        if not isinstance(event, dict) or "error" in event:
            return "error event inside a 200 event stream", data[:500]
    return None


def _response_problem(response: Any, fields: set[str], label: str = "") -> Problem | None:
    """Why ``response`` breaks the property, or None.

    Args:
        fields: the request's possible ``error.param`` values (declared and sent fields).
    """
    status = response.status_code
    if status >= 500:
        return f"HTTP {status}", repr(response.content[:500])
    if 400 <= status < 500:
        return _error_body_problem(response.content, fields, label)
    content_type = (response.headers.get("content-type") or [""])[0]
    if status == 200 and content_type.startswith("text/event-stream"):
        if response.stream_cut_short:
            return "200 event stream still open at the timeout", f"{TIMEOUT_S:.0f} s"
        return _event_stream_problem(response.content, label)
    return None


def _fuzz_operation(operation: Any, mode: Any, seed: int, send: Callable[[Any], None]) -> None:
    """Run Hypothesis over ``operation``'s generated cases in ``mode``, sending each."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as seeded

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @seeded(seed)
    @given(operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        send(case)

    run()


def test_fuzz_openapi(
    fuzz_server: ServerProcess, fuzz_stats: FuzzStats, capsys: pytest.CaptureFixture[str]
) -> None:
    """Positive and negative schemathesis requests: no 5xx, OpenAI 4xx bodies, still healthy."""
    import httpx
    import requests
    import schemathesis
    from hypothesis.errors import Unsatisfiable

    base_url = fuzz_server.url
    config = schemathesis.Config.from_dict(
        {"max-stream-events": 10**9, "request-timeout": TIMEOUT_S}
    )
    raw_schema = _load_schema(base_url)
    declared = _body_fields(raw_schema)
    schema = schemathesis.openapi.from_dict(raw_schema, config=config)
    session = requests.Session()

    def send(case: Any) -> None:
        label = case.operation.label
        start = time.monotonic()
        try:
            response = case.call(base_url=base_url, session=session, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            fuzz_stats.request_seconds += time.monotonic() - start
            fuzz_stats.record(label, type(exc).__name__)
            fuzz_stats.record_failure(
                label, f"no answer: {type(exc).__name__}", repr(exc), _describe(case, base_url)
            )
            return
        fuzz_stats.request_seconds += time.monotonic() - start
        fuzz_stats.record(label, str(response.status_code))
        if 400 <= response.status_code < 500:
            fuzz_stats.record_refusal(label, response.content)
        fields = declared.get(label, set())
        if isinstance(case.body, dict):
            fields = fields | set(case.body)
        problem = _response_problem(response, fields, label)
        if problem is not None:
            fuzz_stats.record_failure(label, *problem, _describe(case, base_url))

    try:
        for index, result in enumerate(schema.get_all_operations()):
            operation = result.ok()
            for mode in schemathesis.GenerationMode:
                try:
                    _fuzz_operation(operation, mode, fuzz_stats.seed + index, send)
                except Unsatisfiable:
                    # A route without parameters or body has no invalid request to make.
                    fuzz_stats.skipped.append(f"{operation.label} {mode.value}: nothing to vary")
    finally:
        session.close()
        with capsys.disabled():
            print("\n" + fuzz_stats.report(), flush=True)

    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as client:
        health = client.get("/health")
        completion = client.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        )
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        )
    assert health.status_code == 200
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 8
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"

    assert not fuzz_stats.failures, (
        f"{len(fuzz_stats.failures)} kinds of failure: {sorted(fuzz_stats.failures)}; "
        "the report above has the shortest request of each"
    )
    assert fuzz_stats.total >= MIN_REQUESTS, f"only {fuzz_stats.total} requests were generated"
    statuses = fuzz_stats.statuses
    assert "200" in statuses and any(key.startswith("4") for key in statuses), (
        "the run never got both a 200 and a 4xx: the generator is not reaching the API"
    )
