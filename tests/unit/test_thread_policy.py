"""The engine's default thread policy (issue 32): adapt to the cores others take on the
CPU, fixed where asked, one thread on CUDA, an equal fixed share per data-parallel engine."""

from __future__ import annotations

import pytest

from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.config import EngineConfig, ModelConfig, engine_config
from trio_llm.server_config import ServerConfig


def _server(*flags: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_the_default_adapts_on_the_cpu_and_not_on_cuda() -> None:
    assert EngineConfig().adapts_threads
    assert engine_config().adapts_threads
    assert not EngineConfig(model=ModelConfig(device="cuda")).adapts_threads
    assert not _server("--device", "cuda").engine.adapts_threads


def test_a_thread_count_or_false_fixes_it() -> None:
    assert not EngineConfig(num_threads=2).adapts_threads
    assert not engine_config(num_threads=1).adapts_threads
    assert not EngineConfig(adaptive_threads=False).adapts_threads
    assert not _server("--num-threads", "2").engine.adapts_threads
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_threads=2, adaptive_threads=True)


def test_data_parallel_engines_get_a_fixed_share_unless_auto_is_asked(monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    ranks = [_server("--data-parallel-size", "2").engine_for_rank(r) for r in range(2)]
    assert [(e.num_threads, e.adapts_threads) for e in ranks] == [(2, False), (2, False)]
    auto = _server("--data-parallel-size", "2", "--num-threads", "auto").engine_for_rank(1)
    assert (auto.num_threads, auto.adapts_threads) == (None, True)
    # One engine keeps the default: adapting.
    assert _server().engine_for_rank(0).adapts_threads
