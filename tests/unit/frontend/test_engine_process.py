"""The engine-core child under a Trio nursery: start, serve, stop, crash, cancel."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio

from tests.support.procfs import (
    detokenizer_children,
    is_running,
    parent_pid,
    server_children,
)
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig
from trio_llm.errors import EngineDeadError, EngineStartupError
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.engine_process import run_engine_process
from trio_llm.messages import SamplingParams

#: Starts engine processes: the slow tier.
pytestmark = pytest.mark.slow

MODES = ["inline", "process"]


def _our_engines() -> set[int]:
    """Engine (and detokenizer) processes started by this test process itself (not by a
    server it runs)."""
    return {pid for pid in server_children() if parent_pid(pid) == os.getpid()}


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=256),
        cache=CacheConfig(num_kv_blocks=64),
        num_threads=1,
    )


async def _collect(engine: EngineClient, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async with engine.open_request(prompt, params) as stream:
        async for delta in stream:
            tokens += delta.token_ids
    return tokens


@pytest.mark.parametrize("mode", MODES)
async def test_start_generate_and_stop(tiny_model_dir: Path, mode: str) -> None:
    async with trio.open_nursery() as nursery:
        engine: EngineClient = await nursery.start(
            partial(run_engine_process, _config(tiny_model_dir), detokenizer_mode=mode)
        )
        assert engine.detokenizes == (mode == "process")
        pid = engine.info.pid
        assert parent_pid(pid) == os.getpid()
        assert engine.info.max_model_len == 256
        params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
        first, second = await _collect(engine, [5, 6, 7], params), None
        async with trio.open_nursery() as inner:

            async def run_second() -> None:
                nonlocal second
                second = await _collect(engine, [5, 6, 7], params)

            inner.start_soon(run_second)
            third = await _collect(engine, [9, 9], params)
        assert len(first) == 7 and first == second and len(third) == 7
        await engine.stop(grace_period=5.0)
    assert not is_running(pid)
    assert _our_engines() == set()


@pytest.mark.parametrize(
    ("mode", "victim"),
    [("inline", "engine"), ("process", "engine"), ("process", "detokenizer")],
)
async def test_killing_a_child_fails_requests_and_the_supervising_task(
    tiny_model_dir: Path, mode: str, victim: str
) -> None:
    errors: list[BaseException] = []
    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            engine: EngineClient = await nursery.start(
                partial(run_engine_process, _config(tiny_model_dir), detokenizer_mode=mode)
            )
            # Found before the request starts: the tiny model could finish a request
            # while /proc is walked. Only our own child: a server that the end-to-end
            # tests keep running has a detokenizer under this process too.
            if victim == "engine":
                pid = engine.info.pid
            else:
                (pid,) = {p for p in detokenizer_children() if parent_pid(p) == os.getpid()}
            params = SamplingParams(max_tokens=250, ignore_eos=True)
            async with engine.open_request([1, 2, 3], params) as stream:
                await stream.__anext__()  # generating
                os.kill(pid, signal.SIGKILL)
                with trio.fail_after(5):
                    try:
                        async for _ in stream:
                            pass
                    except EngineDeadError as exc:
                        errors.append(exc)
            assert not engine.is_alive
    assert len(errors) == 1
    assert raised.group_contains(EngineDeadError)
    assert "SIGKILL" in str(raised.value.exceptions[0])
    assert _our_engines() == set()


@pytest.mark.parametrize("mode", MODES)
async def test_cancelling_the_start_reaps_the_child(tiny_model_dir: Path, mode: str) -> None:
    with trio.move_on_after(0):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                partial(run_engine_process, _config(tiny_model_dir), detokenizer_mode=mode)
            )
    assert _our_engines() == set()


async def test_the_detokenizer_child_sends_text_with_stop_strings_applied(
    tiny_model_dir: Path, smol_tokenizer
) -> None:
    """Process mode: outputs carry the text an inline `RequestDetokenizer` would produce,
    and a stop string finishes the request in the child (aborted in the engine)."""
    from trio_llm.text.output import RequestDetokenizer

    prompt = smol_tokenizer.encode("Once upon a time", add_special_tokens=False)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    async with trio.open_nursery() as nursery:
        engine: EngineClient = await nursery.start(
            partial(run_engine_process, _config(tiny_model_dir), detokenizer_mode="process")
        )
        deltas = []
        async with engine.open_request(prompt, plain) as stream:
            deltas = [delta async for delta in stream]
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 24
        inline = RequestDetokenizer(smol_tokenizer.backend, prompt, plain, frozenset())
        reference = inline.process(tokens, "length", [None] * len(tokens))  # type: ignore[list-item]
        assert reference is not None
        assert "".join(d.text or "" for d in deltas) == reference.text
        # Logprobs travel with the text that releases them: one per token in total.
        assert sum(len(d.logprobs or []) for d in deltas) == 24
        # A stop string taken from the middle of that text ends the request early.
        stop = reference.text[len(reference.text) // 2 :][:3]
        if stop.strip():
            stopping = msgspec.structs.replace(plain, stop=(stop,))
            async with engine.open_request(prompt, stopping) as stream:
                ended = [delta async for delta in stream]
            assert ended[-1].finish_reason == "stop"
            assert ended[-1].stop_reason == stop
            text = "".join(d.text or "" for d in ended)
            assert text == reference.text[: reference.text.index(stop)]
        await engine.stop(grace_period=5.0)
    assert _our_engines() == set()


async def test_an_unloadable_model_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_engine_process, _config(tmp_path / "missing"))
    assert raised.group_contains(EngineStartupError, match="never downloads models")
    assert _our_engines() == set()
