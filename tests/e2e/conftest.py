"""A real server with the real model, shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.server_process import ServerProcess
from trio_llm.text.tokenizer import byte_level_alphabet

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


#: Both process layouts run the same end-to-end tests against the shared server...
DETOKENIZER_MODES = ["inline", "process"]

#: ...except these modules, whose behaviour does not depend on where text is made
#: (validation, tokenization, scheduling and sampling in the engine, the examples, the
#: browser page); they run against the 2-process server only, which keeps ``make test``
#: within its time budget. test_detokenizer_modes compares the two layouts directly.
INLINE_ONLY_MODULES = {
    "test_anthropic_agents",
    "test_agent_frameworks",
    "test_anthropic_api",
    "test_bad_input",
    "test_chaos_client",
    "test_chat_page",
    "test_concurrency",
    "test_context_limits",
    "test_examples",
    "test_hostile_clients",
    "test_hostile_grammars",
    "test_hostile_messages",
    "test_langchain",
    "test_litellm",
    "test_operators",
    "test_prefix_caching",
    "test_responses_agents",
    "test_responses_api",
    "test_sampling_params",
    "test_several_models",
    "test_structured_output_api",
    "test_tools_with_format",
    "test_tokenize",
    "test_tool_calls_api",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the 3-process runs of `INLINE_ONLY_MODULES`."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if (
            callspec is not None
            and callspec.params.get("detokenizer_mode") == "process"
            and name in INLINE_ONLY_MODULES
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=DETOKENIZER_MODES)
def detokenizer_mode(request: pytest.FixtureRequest) -> str:
    """``--detokenizer-mode`` of the shared server (every test using it runs in both)."""
    return request.param


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path, detokenizer_mode: str
) -> Iterator[ServerProcess]:
    """``trio-llm serve`` with the default model, fp32, in each detokenizer mode (started
    once per mode per test session)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = ["--max-num-seqs", "32", "--dtype", "float32", "--detokenizer-mode", detokenizer_mode]
    # Responses are stored by default (OpenAI's store: true): in a store of the session's.
    flags += ["--store-url", f"sqlite:///{log.parent / 'store.db'}"]
    # A short body timeout, so the hostile-client test of a withheld body is quick.
    flags += ["--request-body-timeout", "3"]
    # As `make serve`: tool_choice "auto" with the Hermes parser.
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    process = ServerProcess(flags, log_path=log)
    with process:
        yield process
    assert process.process is not None
    assert process.process.returncode == 0, process.log()


#: The API key, allowed origin and body limit of `guarded_server`.
GUARDED_API_KEY = "sk-operator-test-0123456789"
GUARDED_ORIGIN = "http://example.test"
GUARDED_BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="session")
def guarded_server(
    tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Iterator[ServerProcess]:
    """A small server with an API key, CORS for one origin, a 64 KiB body limit, vLLM's
    metric names and no access log (test_operators; test_hostile_messages' key and
    descriptor tests)."""
    log = tmp_path_factory.mktemp("guarded-server") / "server.log"
    args = ["--dtype", "float32", "--max-num-seqs", "4", "--api-key", GUARDED_API_KEY]
    args += ["--allowed-origins", GUARDED_ORIGIN, "--vllm-metric-names", "--disable-access-log"]
    args += ["--max-request-body-bytes", f"{GUARDED_BODY_LIMIT // 1024}KiB"]
    process = ServerProcess(args, log_path=log)
    with process:
        yield process
    assert process.process is not None
    assert process.process.returncode == 0, process.log()


@pytest.fixture
def base_url(server: ServerProcess) -> str:
    return server.url


def openai_client(url: str) -> OpenAI:
    """The official client for the server at ``url`` (no retries: every answer counts)."""
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(base_url: str) -> Iterator[OpenAI]:
    with openai_client(base_url) as openai:
        yield openai


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once (so the server batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def completion_body(prompt: str | list[str], max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A ``/v1/completions`` body for `MODEL` that generates all its ``max_tokens``
    (``ignore_eos``), with ``fields`` (``stream``, ``n``, ...) besides."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **fields,
    }


def token_id(tokenizer, data: bytes | list[int] | str) -> int:
    """The vocabulary id of the byte-level token spelling exactly ``data``."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    to_char = {byte: char for char, byte in byte_level_alphabet().items()}
    found = tokenizer.backend.token_to_id("".join(to_char[b] for b in raw))
    assert found is not None, raw
    return found
