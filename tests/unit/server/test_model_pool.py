"""The pool of models without processes (`trio_llm.server.model_pool`): fake model starters
that "load" when the test lets them, trio's autojump clock for keep_alive and the load
waits. On-demand loads, one load for concurrent requests, LRU eviction that never takes
a model with a lease, keep_alive, load failures and their retry, unload/load/reload, an
engine failing for good, and the routing of requests by ``model``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from trio_llm.api.http.errors import APIError
from trio_llm.api.model_router import UNCHANGED, LeaseReleaser, hold, peek_model
from trio_llm.config import engine_config
from trio_llm.errors import EngineDeadError, EngineStartupError
from trio_llm.server import model_room
from trio_llm.server.model_catalog import catalog_of
from trio_llm.server.model_memory import MemoryNeed
from trio_llm.server.model_pool import LOAD_RETRY_MIN, ModelPool
from trio_llm.server.supervisor import Lifecycle
from trio_llm.server_config import ModelsConfig, RestartPolicy, ServerConfig

WAIT = 30.0  # --engine-restart-wait: how long a request waits for a load


class FakeEngine:
    """What the pool reads of an engine handle."""

    def __init__(self) -> None:
        self.ended = trio.Event()
        self.error: EngineDeadError | None = None
        self.num_in_flight = 0
        self.num_waiting = 0
        self.draining = False
        self.engines: list[Any] = []

    @property
    def is_alive(self) -> bool:
        return not self.ended.is_set()

    def close_admissions(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        pass

    async def stop(self, grace_period: float) -> None:
        self.ended.set()


class FakeServing:
    def __init__(self, name: str) -> None:
        self.name = name
        self.engine = FakeEngine()
        self.store = None
        self.adapters = None  # no LoRA adapters


class FakeStarter:
    """`run_model` for the pool: a model loads once its gate opens (at once without
    one), or fails with ``fail[model]``; it runs until its engine is stopped."""

    def __init__(self) -> None:
        self.gates: dict[str, trio.Event] = {}
        self.fail: dict[str, str] = {}
        self.starts: Counter[str] = Counter()
        self.running: dict[str, tuple[FakeServing, Any]] = {}
        self.stopped: list[str] = []
        self.configs: dict[str, ServerConfig] = {}

    async def __call__(self, config: ServerConfig, owner: Any, *, model_name, task_status):
        model = config.engine.model.model
        self.starts[model] += 1
        self.configs[model] = config
        if model in self.gates:
            await self.gates[model].wait()
        if model in self.fail:
            raise EngineStartupError(self.fail[model])
        serving = FakeServing(model)
        self.running[model] = (serving, owner)
        task_status.started(serving)
        try:
            await serving.engine.ended.wait()
        finally:
            del self.running[model]
            self.stopped.append(model)


def _config(*models: str, models_dir: Path | None = None, **kw: Any) -> ServerConfig:
    return ServerConfig(
        engine=engine_config(models[0]),
        restart=RestartPolicy(wait=WAIT),
        models=ModelsConfig(
            flagged=tuple((model, ()) for model in models),
            models_dir=str(models_dir) if models_dir else None,
            **kw,
        ),
    )


@asynccontextmanager
async def running_pool(
    config: ServerConfig,
    starter: FakeStarter,
    lifecycle: Lifecycle | None = None,
    check_memory: bool = False,
) -> AsyncIterator[tuple[ModelPool, trio.Nursery]]:
    """A started `ModelPool` over ``starter`` and the nursery it runs in, stopped (1 s
    of grace) when the block ends without an error."""
    pool = ModelPool(
        config,
        catalog_of(config),
        lifecycle or Lifecycle(),
        starter=starter,
        check_memory=check_memory,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        yield pool, nursery
        await pool.stop(1.0)


def _state(pool: ModelPool, name: str) -> str:
    return next(status.state for status in pool.statuses() if name in status.names)


async def test_a_model_loads_on_its_first_request_once_for_all_who_wait(autojump_clock) -> None:
    starter = FakeStarter()
    starter.gates["b"] = trio.Event()
    async with running_pool(_config("a", "b"), starter) as (pool, nursery):
        assert _state(pool, "a") == "loaded" and _state(pool, "b") == "unloaded"
        servings = []

        async def request() -> None:
            lease = await pool.acquire("b")
            servings.append(lease.serving)
            lease.release()

        for _ in range(3):
            nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert _state(pool, "b") == "loading" and servings == []
        # The default model serves meanwhile.
        (await pool.acquire(None)).release()
        starter.gates["b"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert starter.starts["b"] == 1
        assert len(servings) == 3 and len({id(s) for s in servings}) == 1
        assert servings[0].name == "b" and _state(pool, "b") == "loaded"
    assert starter.running == {}


async def test_a_load_that_takes_too_long_is_a_503_and_goes_on(autojump_clock) -> None:
    starter = FakeStarter()
    starter.gates["b"] = trio.Event()
    async with running_pool(_config("a", "b"), starter) as (pool, _nursery):
        with pytest.raises(APIError) as refused:
            await pool.acquire("b")
        assert refused.value.status == 503 and "did not load within 30 s" in refused.value.message
        assert refused.value.headers == {"Retry-After": "1"}
        starter.gates["b"].set()
        (await pool.acquire("b")).release()
        assert starter.starts["b"] == 1


async def test_lru_eviction_never_takes_a_model_with_a_lease(autojump_clock) -> None:
    starter = FakeStarter()
    config = _config("a", "b", "c", max_loaded_models=2)
    async with running_pool(config, starter) as (pool, nursery):
        held = await pool.acquire("a")  # "a" is used, then "b": "a" is the LRU
        (await pool.acquire("b")).release()
        got: list[str] = []

        async def request_c() -> None:
            lease = await pool.acquire("c")
            got.append(lease.serving.name)
            lease.release()

        nursery.start_soon(request_c)
        await trio.testing.wait_all_tasks_blocked()
        # "a" is held: "b", idle, is unloaded instead.
        assert got == ["c"] and starter.stopped == ["b"]
        assert _state(pool, "a") == "loaded" and _state(pool, "b") == "unloaded"
        # Both loaded models busy: a fourth load waits for one to go idle.
        c_lease = await pool.acquire("c")
        waiter = trio.Event()

        async def request_b() -> None:
            (await pool.acquire("b")).release()
            waiter.set()

        nursery.start_soon(request_b)
        await trio.sleep(10)
        assert not waiter.is_set() and set(starter.running) == {"a", "c"}
        held.release()
        await waiter.wait()
        assert starter.stopped == ["b", "a"] and set(starter.running) == {"b", "c"}
        c_lease.release()


async def test_no_place_within_the_wait_is_a_503(autojump_clock) -> None:
    starter = FakeStarter()
    async with running_pool(_config("a", "b", max_loaded_models=1), starter) as (pool, _nursery):
        held = await pool.acquire("a")
        with pytest.raises(APIError) as refused:
            await pool.acquire("b")
        assert refused.value.status == 503
        held.release()
        (await pool.acquire("b")).release()  # now "a" is idle: evicted
        assert starter.stopped == ["a"]


async def test_keep_alive_unloads_an_idle_model(autojump_clock) -> None:
    starter = FakeStarter()
    async with running_pool(_config("a", "b", keep_alive=60.0), starter) as (pool, _nursery):
        lease = await pool.acquire("b")
        await trio.sleep(120)  # held: never unloaded
        assert _state(pool, "b") == "loaded"
        lease.release()
        await trio.sleep(59)
        assert _state(pool, "b") == "loaded"
        await trio.sleep(2)
        assert _state(pool, "b") == "unloaded" and "b" in starter.stopped
        # A request's keep_alive is the model's from then on: 0 unloads it at once.
        (await pool.acquire("b", 0.0)).release()
        await trio.testing.wait_all_tasks_blocked()
        assert _state(pool, "b") == "unloaded" and starter.stopped.count("b") == 2
        # None: forever.
        (await pool.acquire("b", None)).release()
        await trio.sleep(3600)
        assert _state(pool, "b") == "loaded"


async def test_a_failed_load_answers_its_error_and_is_tried_again_later(autojump_clock) -> None:
    starter = FakeStarter()
    starter.fail["b"] = "no such weights"
    lifecycle = Lifecycle()
    async with running_pool(_config("a", "b"), starter, lifecycle) as (pool, _nursery):
        for _ in range(2):
            with pytest.raises(APIError) as failed:
                await pool.acquire("b")
            assert failed.value.status == 500 and failed.value.code == "model_load_failed"
            assert "no such weights" in failed.value.message
        assert starter.starts["b"] == 1 and _state(pool, "b") == "failed"
        assert not lifecycle.stop_requested.is_set()  # the server serves on
        (await pool.acquire("a")).release()
        await trio.sleep(LOAD_RETRY_MIN + 1)
        del starter.fail["b"]
        (await pool.acquire("b")).release()
        assert starter.starts["b"] == 2 and _state(pool, "b") == "loaded"


async def test_post_models_load_retries_a_failed_model_at_once(autojump_clock) -> None:
    starter = FakeStarter()
    starter.fail["b"] = "broken"
    async with running_pool(_config("a", "b"), starter) as (pool, _nursery):
        with pytest.raises(APIError):
            await pool.load("b")
        del starter.fail["b"]
        await pool.load("b")
        assert _state(pool, "b") == "loaded" and starter.starts["b"] == 2


async def test_unload_load_and_reload(autojump_clock, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    (folder / "dir-model").mkdir(parents=True)
    (folder / "dir-model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    starter = FakeStarter()
    async with running_pool(_config("a", models_dir=folder), starter) as (pool, _nursery):
        assert pool.names() == ["a", "dir-model"]
        await pool.unload("a")
        assert _state(pool, "a") == "unloaded" and starter.stopped == ["a"]
        await pool.load("a")
        assert _state(pool, "a") == "loaded" and starter.starts["a"] == 2
        await pool.load("dir-model")
        (folder / "new.gguf").write_bytes(b"GGUF")
        (folder / "dir-model" / "config.json").unlink()
        assert await pool.reload() == (["new"], ["dir-model"])
        await trio.testing.wait_all_tasks_blocked()
        assert pool.names() == ["a", "new"] and str(folder / "dir-model") in starter.stopped[-1]
        with pytest.raises(APIError) as gone:
            await pool.acquire("dir-model")
        assert gone.value.status == 404


async def test_requests_route_by_model_and_unknown_names_are_404(autojump_clock) -> None:
    starter = FakeStarter()
    config = ServerConfig(
        models=ModelsConfig(flagged=(("a", ("chat", "gpt-4o")), ("b", ("embed",))))
    )
    async with running_pool(config, starter) as (pool, _nursery):
        assert pool.names() == ["chat", "gpt-4o", "embed"]
        for name, model in ((None, "a"), ("gpt-4o", "a"), ("embed", "b")):
            lease = await pool.acquire(name)
            assert lease.serving.name == model
            lease.release()
        with pytest.raises(APIError) as unknown:
            await pool.acquire("nope")
        assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
        assert "['chat', 'gpt-4o', 'embed']" in unknown.value.message


async def test_a_models_engines_failing_fail_only_it(autojump_clock) -> None:
    starter = FakeStarter()
    lifecycle = Lifecycle()
    async with running_pool(_config("a", "b"), starter, lifecycle) as (pool, _nursery):
        (await pool.acquire("b")).release()
        _, owner = starter.running["b"]
        owner.request_stop("engine core died: killed by SIGKILL", exit_code=1)
        await trio.testing.wait_all_tasks_blocked()
        assert not lifecycle.stop_requested.is_set() and _state(pool, "b") == "failed"
        with pytest.raises(APIError) as failed:
            await pool.acquire("b")
        assert "killed by SIGKILL" in failed.value.message
        await trio.sleep(3600)  # failed for good: no request loads it again...
        with pytest.raises(APIError):
            await pool.acquire("b")
        (await pool.acquire("a")).release()
        await pool.load("b")  # ...until asked
        assert _state(pool, "b") == "loaded"


async def test_a_single_models_engines_failing_stop_the_server(autojump_clock) -> None:
    starter = FakeStarter()
    lifecycle = Lifecycle()
    async with running_pool(_config("a"), starter, lifecycle) as (pool, _nursery):
        assert not pool.several
        # Any name reaches the one model, whose handlers answer an unknown one with the
        # 404 after checking the body, as a server of one model always did...
        (await pool.acquire("nope")).release()
        with pytest.raises(APIError) as unknown:  # ...but only a real name loads
            await pool.load("nope")
        assert unknown.value.status == 404
        _, owner = starter.running["a"]
        owner.request_stop("engine core died: boom", exit_code=1)
        assert lifecycle.stop_requested.is_set() and lifecycle.exit_code == 1
        assert pool.ended.is_set() and isinstance(pool.error, EngineDeadError)


async def test_the_default_models_failure_stops_the_start_up(autojump_clock) -> None:
    starter = FakeStarter()
    starter.fail["a"] = "cannot start"
    with pytest.raises(BaseExceptionGroup) as raised:
        async with running_pool(_config("a", "b"), starter):
            pass
    assert raised.group_contains(EngineStartupError, match="cannot start")


async def test_the_stop_drains_and_stops_every_model(autojump_clock) -> None:
    starter = FakeStarter()
    starter.gates["c"] = trio.Event()
    async with running_pool(_config("a", "b", "c"), starter) as (pool, nursery):
        (await pool.acquire("b")).release()
        refusals: list[int] = []

        async def request_c() -> None:
            try:
                await pool.acquire("c")
            except APIError as exc:
                refusals.append(exc.status)

        nursery.start_soon(request_c)  # still loading at the stop: cancelled
        await trio.testing.wait_all_tasks_blocked()
        pool.close_admissions()
        await trio.testing.wait_all_tasks_blocked()
        assert refusals == [503]  # the wait ends: the server is stopping
        with pytest.raises(APIError) as refused:
            await pool.acquire("c")
        assert refused.value.status == 503
    assert starter.running == {} and sorted(starter.stopped) == ["a", "b"]


async def test_peek_reads_model_and_keep_alive() -> None:
    assert await peek_model(b'{"model": "m", "keep_alive": "5m"}') == ("m", 300.0)
    assert await peek_model(b'{"model": "m", "keep_alive": -1}') == ("m", None)
    assert await peek_model(b'{"model": 7}') == (None, UNCHANGED)
    assert await peek_model(b"not json") == (None, UNCHANGED)
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert await peek_model(deep) == (None, UNCHANGED)  # the default model's parsing names it
    # What the request parser reads (Python's json) routes as it reads it.
    for odd in (b"NaN", b"Infinity", b"1e400"):
        assert await peek_model(b'{"model": "m", "foo": ' + odd + b"}") == ("m", UNCHANGED)
        with pytest.raises(APIError) as refused:
            await peek_model(b'{"model": "m", "keep_alive": ' + odd + b"}")
        assert refused.value.param == "keep_alive"
    with pytest.raises(APIError) as bad:
        await peek_model(b'{"keep_alive": "soon"}')
    assert bad.value.param == "keep_alive"


async def test_a_lease_is_held_until_the_stream_is_over() -> None:
    """`LeaseReleaser` releases a request's leases after its last body chunk."""
    events: list[str] = []

    class Lease:
        def release(self) -> None:
            events.append("released")

    async def app(scope, receive, send) -> None:
        hold(scope, Lease())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"a", b"b"):
            events.append("sent")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=LeaseReleaser(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/")).text == "ab"
    assert events == ["sent", "sent", "released"]


async def test_memory_idle_models_go_first_then_the_kv_cache_then_a_503(monkeypatch) -> None:
    """Each model needs 3.5 GiB (1 of weights, 2 of KV cache, 0.5 of engine) and 0.5 GiB
    stays free: with 8 GiB, two models fit; a third unloads the idle one; with both busy
    it cannot fit (503); with a little more room it starts with a smaller KV cache. (The
    real clock: the estimate runs in a worker thread, which an autojump clock would not
    wait for.)"""
    gib = 2**30
    monkeypatch.setattr(
        model_room, "estimate", lambda engine, kind, engines: MemoryNeed(gib, 2 * gib, gib // 2)
    )
    available = [8 * gib]
    monkeypatch.setattr(model_room, "available_bytes", lambda: available[0])
    starter = FakeStarter()
    async with running_pool(_config("a", "b", "c"), starter, check_memory=True) as (pool, _nursery):
        (await pool.acquire("b")).release()
        assert starter.configs["b"].engine.cache.kv_cache_memory is None  # as configured
        b_lease = await pool.acquire("b")
        c_lease = await pool.acquire("c")  # "a" is idle and least recently used
        assert starter.stopped == ["a"] and set(starter.running) == {"b", "c"}
        with pytest.raises(APIError) as refused:
            await pool.acquire("a")
        assert refused.value.status == 503 and "does not fit in memory" in refused.value.message
        assert "needs about 3.50 GiB" in refused.value.message
        available[0] = 9 * gib + gib // 4  # 2.25 GiB for "a": 0.25 GiB of KV cache
        (await pool.acquire("a")).release()
        assert starter.configs["a"].engine.cache.kv_cache_memory == gib // 4
        b_lease.release()
        c_lease.release()


async def test_a_model_that_cannot_fit_is_refused_before_anything_is_unloaded(
    monkeypatch,
) -> None:
    """Issue 41, item 5: a model whose header claims 4 x 2^62 elements would not fit with
    every idle model unloaded and the smallest KV cache: a 503 at once, and the loaded
    default model stays loaded (it was unloaded first; with --max-loaded-models 1, to
    make a place for it)."""
    gib = 2**30
    needs = {
        "a": MemoryNeed(gib, 2 * gib, gib // 2),
        "huge": MemoryNeed(4 * 2**62 * 4, 2 * gib, gib // 2),
    }
    monkeypatch.setattr(
        model_room, "estimate", lambda engine, kind, engines: needs[engine.model.model]
    )
    monkeypatch.setattr(model_room, "available_bytes", lambda: 8 * gib)
    for limit in (None, 1):
        starter = FakeStarter()
        config = _config("a", "huge", max_loaded_models=limit)
        async with running_pool(config, starter, check_memory=True) as (pool, _nursery):
            with pytest.raises(APIError) as refused:
                await pool.acquire("huge")
            assert refused.value.status == 503
            assert "does not fit in memory" in refused.value.message
            assert _state(pool, "a") == "loaded" and starter.stopped == []
            assert "huge" not in starter.starts
            (await pool.acquire("a")).release()
