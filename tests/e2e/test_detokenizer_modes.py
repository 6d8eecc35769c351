"""The same requests through a 2-process and a 3-process server give identical answers.

Text, finish reasons, stop reasons, logprobs and usage must not depend on which process
detokenizes; only ids and timestamps may differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import parallel
from tests.support.procfs import detokenizer_children
from tests.support.server_process import ServerProcess

# A fixed thread count: the default adapts to the load (the other server here), and float32
# logprobs depend on the thread count at the 1e-6 level.
FLAGS = ["--max-num-seqs", "16", "--dtype", "float32", "--num-threads", "1"]

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The first five prime numbers are", "max_tokens": 24}),
    (
        "/v1/completions",
        {"prompt": "Count: 1, 2, 3,", "max_tokens": 40, "stop": [", 9", "\n"], "logprobs": 2},
    ),
    (
        "/v1/completions",
        {
            "prompt": ["Water boils at", "The sky is"],
            "max_tokens": 12,
            "n": 2,
            "temperature": 0.8,
            "seed": 7,
            "echo": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 30,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": ["."],
            "include_stop_str_in_output": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Say hello in French."}],
            "max_tokens": 20,
            "skip_special_tokens": False,
        },
    ),
]


def _start(mode: str, log: Path) -> ServerProcess:
    server = ServerProcess([*FLAGS, "--detokenizer-mode", mode], log_path=log)
    server.start()
    return server


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    folder = tmp_path_factory.mktemp("modes")
    started = parallel(
        lambda: _start("inline", folder / "inline.log"),
        lambda: _start("process", folder / "process.log"),
    )
    try:
        yield dict(zip(["inline", "process"], started, strict=True))
    finally:
        for server in started:
            server.close()


def _strip(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return _strip(response.json())


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    payload.setdefault("temperature", 0.0)
    with httpx.stream("POST", url + path, json=payload, timeout=120) as response:
        assert response.status_code == 200
        events = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    return [_strip(json.loads(event)) for event in events[:-1]]


def test_the_3_process_server_has_a_detokenizer_child(servers) -> None:
    assert len(detokenizer_children(servers["process"].pid)) == 1
    assert detokenizer_children(servers["inline"].pid) == set()


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=lambda v: str(v)[:30])
def test_both_modes_answer_identically(servers, path: str, body: dict[str, Any]) -> None:
    body = {"temperature": 0.0, **body}
    # One server at a time: two engines computing at once on a 2-core machine
    # oversubscribe the cores (each runs 2 torch threads) and both slow down several-fold.
    inline = _post(servers["inline"].url, path, body)
    process = _post(servers["process"].url, path, body)
    assert process == inline
    assert inline["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=lambda v: str(v)[:30])
def test_both_modes_stream_identically(servers, path: str, body: dict[str, Any]) -> None:
    """The chunk boundaries may differ (text is released at different moments); what the
    chunks add up to may not."""
    if body.get("echo"):
        pytest.skip("echo is the same prompt text in both modes; covered non-streamed")
    body = {"temperature": 0.0, **body}
    results = [_stream(servers[mode].url, path, body) for mode in ("inline", "process")]
    summaries = []
    for chunks in results:
        texts: dict[int, str] = {}
        finishes: dict[int, tuple[Any, Any]] = {}
        logprob_tokens: dict[int, list[Any]] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                index = choice["index"]
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[index] = texts.get(index, "") + piece
                if choice.get("finish_reason"):
                    finishes[index] = (choice["finish_reason"], choice.get("stop_reason"))
                logprobs = choice.get("logprobs")
                if logprobs:
                    tokens = logprobs.get("tokens") or [e["token"] for e in logprobs["content"]]
                    logprob_tokens.setdefault(index, []).extend(tokens)
        summaries.append((texts, finishes, logprob_tokens, chunks[-1]["usage"]))
    assert summaries[1] == summaries[0]
