"""Operator settings on a real server: API key, CORS, the request body limit and the
access log, over HTTP and the WebSocket.

One extra server (the session's ``guarded_server``, shared with test_hostile_messages),
started with ``--api-key``, ``--allowed-origins``, a 64 KiB body limit and
``--disable-access-log``; the access log's own test reads the shared ``server``'s log. The
last tests check the command line and `ServerConfig` alone.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import trio

from tests.e2e.conftest import (
    GUARDED_API_KEY,
    GUARDED_BODY_LIMIT,
    GUARDED_ORIGIN,
    MODEL,
)
from tests.support.metrics_scrape import poll
from tests.support.server_process import ServerProcess
from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.client import ConnectionClosedError, DoneEvent, open_ws_client
from trio_llm.server_config import API_KEY_ENV, ServerConfig

API_KEY = GUARDED_API_KEY
ALLOWED_ORIGIN = GUARDED_ORIGIN
BODY_LIMIT = GUARDED_BODY_LIMIT
AUTH = {"authorization": f"Bearer {API_KEY}"}
SMALL_REQUEST = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}


@pytest.fixture
def guarded(guarded_server: ServerProcess) -> str:
    """Base URL of the server with an API key, CORS for one origin, a 64 KiB body limit
    and vLLM's metric names (`tests.e2e.conftest.guarded_server`)."""
    return guarded_server.url


@pytest.fixture
def client(guarded: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded, timeout=60) as http:
        yield http


def _assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert error["message"]
    return error


def _assert_still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=SMALL_REQUEST, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ API key


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-wrong"},
        {"authorization": f"Bearer {API_KEY}x"},
        {"authorization": f"Bearer {API_KEY[:-1]}"},
        {"authorization": f"Basic {API_KEY}"},
        {"authorization": API_KEY},
        {"x-api-key": "sk-wrong"},
        {"x-api-key": f"Bearer {API_KEY}"},
    ],
    ids=["none", "wrong", "longer", "shorter", "basic", "no-scheme", "wrong-x-api-key", "x-bearer"],
)
def test_v1_routes_need_the_key(client: httpx.Client, headers: dict[str, str]) -> None:
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ]:
        body = SMALL_REQUEST if method == "POST" else None
        response = client.request(method, path, json=body, headers=headers)
        error = _assert_error(response, 401, "invalid_api_key")
        assert error["param"] is None
        assert response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text


def test_the_right_key_works_with_the_openai_client(guarded: str) -> None:
    with openai.OpenAI(base_url=f"{guarded}/v1", api_key=API_KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        stream = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_the_anthropic_client_sends_the_key_as_x_api_key(guarded: str) -> None:
    # Anthropic's clients send the key in `x-api-key`; a wrong one gets Anthropic's 401.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with anthropic.Anthropic(base_url=guarded, api_key=API_KEY, max_retries=0) as client:
        reply = client.messages.create(model=MODEL, max_tokens=4, messages=question)
        assert reply.content and reply.usage.output_tokens >= 1
    with anthropic.Anthropic(base_url=guarded, api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            client.messages.create(model=MODEL, max_tokens=4, messages=question)
    body = raised.value.body
    assert body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": body["error"]["message"]},
    }
    assert API_KEY not in body["error"]["message"]


def test_the_openai_client_reports_a_wrong_key(guarded: str) -> None:
    with openai.OpenAI(base_url=f"{guarded}/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


def test_operational_routes_stay_open(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert "# TYPE" in metrics.text
    assert client.get("/version").status_code == 200
    tokens = client.post("/tokenize", json={"prompt": "hi"})
    assert tokens.status_code == 200
    assert client.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json() == {
        "prompt": "hi"
    }


# ------------------------------------------------------------------ CORS


def _preflight(client: httpx.Client, origin: str) -> httpx.Response:
    return client.options(
        "/v1/chat/completions",
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )


def test_cors_preflight_allows_the_configured_origin(client: httpx.Client) -> None:
    response = _preflight(client, ALLOWED_ORIGIN)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers
    # The actual request carries the header too, on success and on a 401 alike (so a
    # browser page can read why it was refused).
    ok = client.get("/v1/models", headers={"origin": ALLOWED_ORIGIN, **AUTH})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    refused = client.get("/v1/models", headers={"origin": ALLOWED_ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_cors_refuses_another_origin(client: httpx.Client) -> None:
    response = _preflight(client, "http://elsewhere.test")
    assert response.status_code == 400
    assert "access-control-allow-origin" not in response.headers
    actual = client.get("/v1/models", headers={"origin": "http://elsewhere.test", **AUTH})
    assert actual.status_code == 200
    assert "access-control-allow-origin" not in actual.headers


# ------------------------------------------------------------------ body size


def _oversized_body() -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "word " * BODY_LIMIT, "max_tokens": 1})
    assert len(body) > BODY_LIMIT
    return body.encode()


def test_a_body_with_a_large_content_length_gets_413(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions",
        content=_oversized_body(),
        headers={"content-type": "application/json", **AUTH},
    )
    error = _assert_error(response, 413, "request_too_large")
    assert str(BODY_LIMIT) in error["message"]
    assert response.headers["connection"] == "close"
    _assert_still_serving(client)


def test_a_chunked_body_that_grows_too_large_gets_413(client: httpx.Client) -> None:
    body = _oversized_body()
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for start in range(0, len(body), 4096):
            sent += len(body[start : start + 4096])
            yield body[start : start + 4096]

    request = client.build_request(
        "POST",
        "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json", **AUTH},
    )
    assert "content-length" not in request.headers
    assert request.headers["transfer-encoding"] == "chunked"
    response = client.send(request)
    error = _assert_error(response, 413, "request_too_large")
    assert str(BODY_LIMIT) in error["message"]
    _assert_still_serving(client)


def test_bodies_within_the_limit_pass_chunked_or_not(client: httpx.Client) -> None:
    body = json.dumps(SMALL_REQUEST).encode()
    headers = {"content-type": "application/json", **AUTH}

    def chunks() -> Iterator[bytes]:
        yield from (body[i : i + 7] for i in range(0, len(body), 7))

    response = client.post("/v1/completions", content=chunks(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    # Exactly at the limit, sent whole and chunked: refused by the context length (400),
    # not by the size (413).
    overhead = len(json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1}))
    prompt = ("a " * BODY_LIMIT)[: BODY_LIMIT - overhead]
    at_limit = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    assert len(at_limit) == BODY_LIMIT
    for content in (at_limit, iter([at_limit[:1000], at_limit[1000:]])):
        response = client.post("/v1/completions", content=content, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"


# ------------------------------------------------------------------ WebSocket


async def _ws_generate(url: str, api_key: str | None, **params: object) -> DoneEvent:
    """One completion over ``/v1/ws`` at ``url``; its `DoneEvent`."""
    async with open_ws_client(url, api_key=api_key) as ws:
        events = [e async for e in ws.generate("completion", model=MODEL, **params)]
    assert isinstance(events[-1], DoneEvent)
    return events[-1]


async def test_the_websocket_needs_the_key(guarded: str) -> None:
    url = guarded.replace("http://", "ws://") + "/v1/ws"
    for key in (None, "wrong"):
        with pytest.raises(ConnectionClosedError) as closed:
            await _ws_generate(url, key, prompt="Hi", max_tokens=2)
        assert (closed.value.code, closed.value.reason) == (1008, "invalid or missing API key")
    for full_url, key in ((url, API_KEY), (f"{url}?api_key={API_KEY}", None)):
        done = await _ws_generate(full_url, key, prompt="Hi", max_tokens=2)
        assert done.usage["completion_tokens"] == 2


async def test_an_oversized_websocket_message_closes_with_1009(guarded: str) -> None:
    url = guarded.replace("http://", "ws://") + "/v1/ws"
    async with open_ws_client(url, api_key=API_KEY) as ws:
        # `user` is accepted and ignored: it only makes the message long.
        short = [
            e
            async for e in ws.generate(
                "completion", model=MODEL, prompt="Hi", max_tokens=1, user="x" * (BODY_LIMIT - 1024)
            )
        ]
        assert isinstance(short[-1], DoneEvent)
        with pytest.raises(ConnectionClosedError) as closed:
            async for _ in ws.generate(
                "completion", model=MODEL, prompt="Hi", max_tokens=1, user="x" * BODY_LIMIT
            ):
                pass
    assert closed.value.code == 1009


# ------------------------------------------------------------------ access log


async def test_the_access_log_has_a_line_per_request(server: ServerProcess) -> None:
    """Method, path with its query, status, duration and request id on stderr, never a
    header; a stream's line once it ended, and a client that hung up said so."""
    start = len(server.log())
    auth = {"authorization": "Bearer sk-never-logged"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert (await http.get("/v1/models?after=a%20b", headers=auth)).status_code == 200
        assert (await http.get("/v1/no-such-route")).status_code == 404
        async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200
            assert [line async for line in r.aiter_lines() if line][-1] == "data: [DONE]"
        endless = {**chat, "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/chat/completions?left=1", json=endless) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # the first token: hang up

    line = r'^trio-llm: 127\.0\.0\.1:\d+ "{}" {} \d+\.\d{{3}}s req_[0-9a-f]{{24}}{}$'
    expected = [
        line.format(r"GET /v1/models\?after=a%20b HTTP/1\.1", 200, ""),
        line.format(r"GET /v1/no-such-route HTTP/1\.1", 404, ""),
        line.format(r"POST /v1/chat/completions HTTP/1\.1", 200, ""),
        line.format(r"POST /v1/chat/completions\?left=1 HTTP/1\.1", 200, r" \(client hung up\)"),
    ]

    async def all_logged() -> bool:
        new = server.log()[start:]
        return all(re.search(pattern, new, re.MULTILINE) for pattern in expected)

    with contextlib.suppress(trio.TooSlowError):  # the assertions below say what is missing
        await poll(all_logged, 30)
    new = server.log()[start:]
    for pattern in expected:
        assert re.search(pattern, new, re.MULTILINE), (pattern, new)
    assert "sk-never-logged" not in new


def test_disable_access_log_writes_no_line(
    client: httpx.Client, guarded_server: ServerProcess
) -> None:
    start = len(guarded_server.log())
    assert client.post("/v1/completions", json=SMALL_REQUEST, headers=AUTH).status_code == 200
    assert client.get("/v1/models?x=1", headers=AUTH).status_code == 200
    assert client.get("/health").status_code == 200
    assert "/v1/models?x=1" not in guarded_server.log()[start:]
    assert "/v1/completions" not in guarded_server.log()[start:]


def test_the_access_log_flag_and_vllms_alias() -> None:
    assert _parse().disable_access_log is False
    assert _parse("--disable-access-log").disable_access_log is True
    assert _parse("--disable-uvicorn-access-log").disable_access_log is True


# ------------------------------------------------------------------ command line


def _parse(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_command_line_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = _parse()
    assert config.api_key is None
    assert config.allowed_origins == ()
    assert config.allowed_methods == ("*",)
    assert config.allowed_headers == ("*",)
    assert config.allow_credentials is False
    assert config.max_request_body_bytes == 8 * 1024**2
    assert config.max_num_waiting_requests is None
    assert config.max_logprobs == 20


def test_command_line_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    config = _parse(
        "--api-key",
        "sk-flag",
        "--allowed-origins",
        "http://a.test",
        "http://b.test",
        "--allowed-methods",
        "GET",
        "POST",
        "--allowed-headers",
        "authorization",
        "--allow-credentials",
        "--max-request-body-bytes",
        "1MiB",
        "--max-num-waiting-requests",
        "3",
        "--max-logprobs",
        "0",
    )
    assert config.api_key == "sk-flag"
    assert config.allowed_origins == ("http://a.test", "http://b.test")
    assert config.allowed_methods == ("GET", "POST")
    assert config.allowed_headers == ("authorization",)
    assert config.allow_credentials is True
    assert config.max_request_body_bytes == 1024**2
    assert config.max_num_waiting_requests == 3
    assert config.max_logprobs == 0
    assert "sk-flag" not in repr(config)


def test_the_api_key_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert _parse().api_key == "sk-from-env"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _parse().api_key is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-waiting-requests", "0"],
        ["--max-logprobs", "-1"],
        ["--max-request-body-bytes", "lots"],
        ["--max-request-body-bytes", "0"],
        ["--api-key", ""],
        ["--api-key", "two words"],
    ],
)
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parser = build_parser()
        try:
            config_from_args(parser.parse_args(["serve", *argv]))
        except ValueError as exc:
            parser.error(str(exc))
    assert caught.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_request_body_bytes", 0),
        ("max_num_waiting_requests", 0),
        ("max_logprobs", -1),
        ("api_key", ""),
        ("allowed_origins", "http://a.test"),
        ("allowed_origins", ("",)),
        ("allowed_methods", ()),
    ],
)
def test_server_config_validates(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_metrics_are_also_listed_under_vllm_names(client: httpx.Client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert client.post("/v1/completions", json=SMALL_REQUEST, headers=AUTH).status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }
    ours = {key: value for key, value in samples.items() if key[0].startswith("trio_llm:")}
    assert ("trio_llm:num_requests_waiting", (("engine", "0"), ("model_name", MODEL))) in ours
    for (name, labels), value in ours.items():
        twin = samples.get(("vllm:" + name.removeprefix("trio_llm:"), labels))
        # One rendering, two names: every value and label set is the same.
        assert twin == value, name
