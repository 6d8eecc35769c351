"""The engine-core child under a Trio nursery: start, serve, stop, crash, cancel."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from trio_llm.config import CacheConfig, EngineConfig, ModelConfig
from trio_llm.frontend.engine_client import EngineClient, EngineDeadError
from trio_llm.frontend.engine_process import EngineStartupError, run_engine_process
from trio_llm.messages import SamplingParams
from trio_llm.testing.procfs import engine_children, is_running, parent_pid


def _our_engines() -> set[int]:
    """Engine processes started by this test process itself (not by a server it runs)."""
    return {pid for pid in engine_children() if parent_pid(pid) == os.getpid()}


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


async def test_start_generate_and_stop(tiny_model_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        engine: EngineClient = await nursery.start(run_engine_process, _config(tiny_model_dir))
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


async def test_killing_the_child_fails_requests_and_the_supervising_task(
    tiny_model_dir: Path,
) -> None:
    errors: list[BaseException] = []
    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            engine: EngineClient = await nursery.start(run_engine_process, _config(tiny_model_dir))
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async with engine.open_request([1, 2, 3], params) as stream:
                await stream.__anext__()  # generating
                os.kill(engine.info.pid, signal.SIGKILL)
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


async def test_cancelling_the_start_reaps_the_child(tiny_model_dir: Path) -> None:
    with trio.move_on_after(0):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_engine_process, _config(tiny_model_dir))
    assert _our_engines() == set()


async def test_an_unloadable_model_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_engine_process, _config(tmp_path / "missing"))
    assert raised.group_contains(EngineStartupError, match="never downloads models")
    assert _our_engines() == set()
