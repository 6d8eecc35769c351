"""--data-parallel-size: routing over N engine clients, one engine's death, drain, health.

Each engine core is played by the test over an in-memory stream (`FakeEngine`), so which
engine holds which request, and when one dies, is known exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import httpx
import pytest
import trio
import trio.testing

from tests.unit.conftest import INFO, FakeEngine, ScriptedEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.config import EngineConfig, engine_config
from trio_llm.engine.loop import select_gpu
from trio_llm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineStartupError,
)
from trio_llm.frontend.data_parallel import PREFIX_SLACK, DataParallelClient, prefix_block_hashes
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.messages import SamplingParams
from trio_llm.model_files import dtype_choice
from trio_llm.server import engine_fleet, supervisor
from trio_llm.server_config import ServerConfig

PARAMS = SamplingParams(max_tokens=5)
BLOCK = INFO.block_size


class Fleet:
    """N engine clients, each with its fake engine core, behind one `DataParallelClient`."""

    def __init__(
        self,
        nursery: trio.Nursery,
        size: int,
        *,
        prefix_aware: bool = True,
        make: Callable[[trio.abc.Stream], FakeEngine] = FakeEngine,
    ) -> None:
        self.clients: list[EngineClient] = []
        self.fakes: list[FakeEngine] = []
        self.streams: list[trio.abc.Stream] = []
        self.scopes: list[tuple[trio.CancelScope, trio.Event]] = []
        for _ in range(size):
            client, stream = engine_client_pair()
            fake = make(stream)
            scope, done = trio.CancelScope(), trio.Event()
            nursery.start_soon(client.route_outputs)
            nursery.start_soon(self._run, fake, scope, done)
            self.clients.append(client)
            self.fakes.append(fake)
            self.streams.append(stream)
            self.scopes.append((scope, done))
        self.group = DataParallelClient(self.clients, prefix_aware=prefix_aware)

    @staticmethod
    async def _run(fake: FakeEngine, scope: trio.CancelScope, done: trio.Event) -> None:
        with scope:
            await fake.run()
        done.set()

    async def holder(self, request_id: str) -> int:
        """The rank of the engine that received ``request_id`` (once it arrived)."""
        await trio.testing.wait_all_tasks_blocked()  # every message sent is received
        (rank,) = [i for i, fake in enumerate(self.fakes) if request_id in fake.added]
        return rank

    async def kill(self, rank: int) -> None:
        """End engine ``rank``'s channel, as a SIGKILLed child does."""
        scope, done = self.scopes[rank]
        scope.cancel()
        await done.wait()
        await self.streams[rank].aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert not self.clients[rank].is_alive


def prompt(prefix: int, blocks: int, tail: int = 0) -> list[int]:
    """``blocks`` full KV blocks that depend on ``prefix``, then ``tail`` other tokens."""
    return [prefix * 1000 + i for i in range(blocks * BLOCK)] + [7] * tail


async def test_idle_engines_take_requests_in_turn_then_the_least_loaded_one() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2, prefix_aware=False)
        async with (
            fleet.group.open_request([1, 2, 3], PARAMS) as a,
            fleet.group.open_request([1, 2, 3], PARAMS) as b,
        ):
            await fleet.fakes[0].wait_for_requests(1)
            await fleet.fakes[1].wait_for_requests(1)
            assert {await fleet.holder(a.request_id), await fleet.holder(b.request_id)} == {0, 1}
            # Engine 0 gets a second request; the next one goes to engine 1, however
            # the turns fall.
            async with fleet.group.open_request([4], PARAMS) as c:
                loaded = await fleet.holder(c.request_id)
                async with fleet.group.open_request([5], PARAMS) as d:
                    assert await fleet.holder(d.request_id) == 1 - loaded
        assert fleet.group.num_in_flight == 0
        nursery.cancel_scope.cancel()


async def test_a_shared_prefix_goes_back_to_its_engine_unless_that_one_is_far_busier() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2)
        group = fleet.group
        async with group.open_request(prompt(1, 3, tail=5), PARAMS) as first:
            home = await fleet.holder(first.request_id)
        for tail in range(1, 4):  # other questions after the same system prompt
            async with group.open_request(prompt(1, 3, tail=tail), PARAMS) as again:
                assert await fleet.holder(again.request_id) == home
        # Busier by up to PREFIX_SLACK requests, the home engine still gets the prefix.
        async with trio.open_nursery() as busy:
            release = trio.Event()
            opened = trio.Semaphore(0)

            async def hold(tokens: list[int]) -> None:
                async with group.open_requests([(tokens, PARAMS)] * 1) as (stream,):
                    assert await fleet.holder(stream.request_id) == home
                    opened.release()
                    await release.wait()

            for i in range(PREFIX_SLACK):
                busy.start_soon(hold, prompt(1, 3, tail=10 + i))
                await opened.acquire()
            assert fleet.clients[home].load == PREFIX_SLACK
            async with group.open_request(prompt(1, 3, tail=20), PARAMS) as slack:
                assert await fleet.holder(slack.request_id) == home
                # One more than the slack: the least-loaded engine takes it.
                async with group.open_request(prompt(1, 3, tail=21), PARAMS) as spill:
                    assert await fleet.holder(spill.request_id) == 1 - home
            release.set()
        # A prompt without a full block in common goes to the least loaded, in turn.
        async with group.open_request(prompt(2, 3), PARAMS) as other:
            assert await fleet.holder(other.request_id) in (0, 1)
        nursery.cancel_scope.cancel()


async def test_the_longest_matching_prefix_wins() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2)
        group = fleet.group
        short_home = group.route(prompt(1, 1))
        # While that engine is far busier, the longer prompt goes to the other one.
        busy = fleet.clients[short_home].admit(PREFIX_SLACK + 1, None)
        long_home = group.route(prompt(1, 4))
        assert long_home != short_home
        fleet.clients[short_home].release(busy)
        async with group.open_request(prompt(1, 4, tail=3), PARAMS) as again:
            assert await fleet.holder(again.request_id) == long_home
        nursery.cancel_scope.cancel()


def test_prefix_block_hashes_depend_on_every_earlier_block() -> None:
    base = list(range(3 * BLOCK + 5))
    hashes = prefix_block_hashes(base, BLOCK)
    assert len(hashes) == 3  # the partial block is not hashed, as in the engine
    changed = base.copy()
    changed[BLOCK + 1] += 1  # inside the second block
    other = prefix_block_hashes(changed, BLOCK)
    assert other[0] == hashes[0]
    assert other[1] != hashes[1] and other[2] != hashes[2]
    assert prefix_block_hashes(base[: BLOCK - 1], BLOCK) == []


async def test_one_engine_dying_fails_only_its_requests_and_the_other_serves() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2, prefix_aware=False)
        group = fleet.group
        async with (
            group.open_request([1], PARAMS) as a,
            group.open_request([2], PARAMS) as b,
        ):
            doomed = await fleet.holder(a.request_id)
            survivor = await fleet.holder(b.request_id)
            assert doomed != survivor
            await fleet.kill(doomed)
            with pytest.raises(EngineDeadError):
                await a.__anext__()
            assert group.is_alive and group.num_serving == 1 and group.error is None
            await fleet.fakes[survivor].output(b.request_id, "length")
            delta = await b.__anext__()
            assert delta.finish_reason == "length"
        for _ in range(3):  # every new request goes to the engine that is left
            async with group.open_request([3], PARAMS) as c:
                assert await fleet.holder(c.request_id) == survivor
        assert not group.ended.is_set()
        await fleet.kill(survivor)
        group.engine_ended()
        assert group.ended.is_set() and not group.is_alive
        assert isinstance(group.error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            group.admit(1, None)
        with pytest.raises(EngineDeadError):
            async with group.open_request([4], PARAMS):
                pass
        nursery.cancel_scope.cancel()


async def test_health_is_degraded_with_the_count_and_metrics_label_each_engine(
    smol_tokenizer,
) -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2)
        serving = ModelServing(fleet.group, smol_tokenizer, ("m",))
        app = build_app(serving, lambda: True)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            healthy = await client.get("/health")
            assert healthy.status_code == 200 and healthy.content == b""
            await fleet.kill(1)
            degraded = await client.get("/health")
            assert degraded.status_code == 200
            body = degraded.json()
            assert body["status"] == "degraded"
            assert body["engines_serving"] == 1 and body["data_parallel_size"] == 2
            assert body["engines"][0] == {"engine": 0, "state": "serving"}
            assert body["engines"][1]["state"] == "failed"
            assert "exited unexpectedly" in body["engines"][1]["error"]
            text = (await client.get("/metrics")).text
            assert 'trio_llm:engine_healthy{engine="0",model_name="m"} 1.0' in text
            assert 'trio_llm:engine_healthy{engine="1",model_name="m"} 0.0' in text
            await fleet.kill(0)
            gone = await client.get("/health")
            assert gone.status_code == 503
            assert "exited unexpectedly" in gone.json()["error"]["message"]
        nursery.cancel_scope.cancel()


async def test_a_request_naming_its_engine_goes_there_and_a_bad_rank_is_a_400(
    smol_tokenizer,
) -> None:
    """vLLM's ``X-data-parallel-rank`` header: the engine it names takes the request
    (whatever the router would choose), in any letter case; a rank past the engines, or
    not a number, is a 400 naming the header, and nothing reaches an engine."""
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2, make=lambda stream: ScriptedEngine(stream, [28, 29]))
        serving = ModelServing(fleet.group, smol_tokenizer, ("m",))
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        body = {"model": "m", "prompt": "Hello there", "max_tokens": 4}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            expected = [0, 0]
            for rank in (1, 1, 0, 1):  # the same prompt: the router alone would keep it
                name = "X-data-parallel-rank" if rank else "x-DATA-parallel-RANK"
                reply = await client.post("/v1/completions", json=body, headers={name: str(rank)})
                assert reply.status_code == 200, reply.text
                expected[rank] += 1
                assert [len(fake.added) for fake in fleet.fakes] == expected
            assert expected == [1, 3]
            for bad in ("2", "-1", "one", "1.0", "", "+1", "9" * 400):
                refused = await client.post(
                    "/v1/completions", json=body, headers={"X-data-parallel-rank": bad}
                )
                assert refused.status_code == 400, (bad, refused.text)
                error = refused.json()["error"]
                assert error["param"] == "X-data-parallel-rank" and "[0, 2)" in error["message"]
            assert [len(fake.added) for fake in fleet.fakes] == [1, 3]
        nursery.cancel_scope.cancel()


async def test_the_waiting_limit_counts_every_engine() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2, prefix_aware=False)
        group = fleet.group
        admission = group.admit(2, limit=3)
        async with group.open_requests([([1], PARAMS), ([2], PARAMS)], admission) as streams:
            # Both choices of one request go to one engine.
            assert len({await fleet.holder(s.request_id) for s in streams}) == 1
            group.admit(1, limit=3)
            with pytest.raises(EngineOverloadedError):
                group.admit(1, limit=3)
        nursery.cancel_scope.cancel()


async def test_draining_lets_admitted_requests_run_on_any_engine_and_waits_for_all() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 2, prefix_aware=False)
        group = fleet.group
        admitted = group.admit(1, None)
        idle = trio.Event()
        async with group.open_request([1], PARAMS) as running:
            group.close_admissions()
            with pytest.raises(EngineShutdownError):
                group.admit(1, None)

            async def wait_idle() -> None:
                await group.wait_idle()
                idle.set()

            nursery.start_soon(wait_idle)
            async with group.open_requests([([2], PARAMS)], admitted) as (late,):
                await fleet.fakes[await fleet.holder(late.request_id)].output(
                    late.request_id, "stop"
                )
                await late.__anext__()
            await fleet.fakes[await fleet.holder(running.request_id)].output(
                running.request_id, "stop"
            )
            await running.__anext__()
            await trio.testing.wait_all_tasks_blocked()
            assert not idle.is_set()  # the block is still open
        with trio.fail_after(5):
            await idle.wait()
        nursery.cancel_scope.cancel()


async def test_stop_stops_every_engine() -> None:
    async with trio.open_nursery() as nursery:
        fleet = Fleet(nursery, 3)
        await fleet.group.stop(1.0)
        assert fleet.group.ended.is_set()
        assert all(client.stopping for client in fleet.clients)
        with pytest.raises(EngineShutdownError):
            fleet.group.admit(1, None)
        nursery.cancel_scope.cancel()


def test_cpu_engines_share_the_cores_and_keep_explicit_threads(monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    config = ServerConfig(data_parallel_size=3)
    ranks = [config.engine_for_rank(rank) for rank in range(3)]
    assert [engine.data_parallel_rank for engine in ranks] == [0, 1, 2]
    assert [engine.num_threads for engine in ranks] == [2, 2, 2]
    explicit = ServerConfig(engine=engine_config(num_threads=4), data_parallel_size=2)
    assert explicit.engine_for_rank(1).num_threads == 4
    assert ServerConfig().engine_for_rank(0) == EngineConfig()  # one engine: unchanged
    crowded = ServerConfig(data_parallel_size=8)
    assert crowded.engine_for_rank(7).num_threads == 1
    with pytest.raises(ValueError, match="needs a CPU core per engine; this machine has 8"):
        ServerConfig(data_parallel_size=9)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ServerConfig(data_parallel_size=0)
    assert dataclasses.replace(config, data_parallel_size=1).engine_for_rank(0).num_threads is None


def test_each_cuda_engine_sees_its_own_gpu() -> None:
    environ: dict[str, str] = {}
    assert select_gpu(1, environ) is None
    assert environ["CUDA_VISIBLE_DEVICES"] == "1"
    environ = {"CUDA_VISIBLE_DEVICES": "4, 6"}
    assert select_gpu(1, environ) is None
    assert environ["CUDA_VISIBLE_DEVICES"] == "6"
    problem = select_gpu(2, {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert problem is not None and "lists 2" in problem


class _FakeProcesses:
    """`run_engine_process` for `supervisor.supervise_engines`: engine ``rank`` is ready
    at once (an in-memory client) unless it is in ``loading``; it fails for good when
    the test sets ``fail[rank]``."""

    def __init__(self, size: int, loading: set[int] = frozenset()) -> None:
        self.loading = loading
        self.fail = [trio.Event() for _ in range(size)]
        self.clients: dict[int, EngineClient] = {}
        #: Each engine's config.
        self.configs: dict[int, EngineConfig] = {}

    async def __call__(
        self, engine_config: EngineConfig, *, data_parallel_rank: int, task_status, **_: object
    ) -> None:
        self.configs[data_parallel_rank] = engine_config
        if data_parallel_rank in self.loading:
            await trio.sleep_forever()
        client, _stream = engine_client_pair(INFO)
        self.clients[data_parallel_rank] = client
        task_status.started(client)
        await self.fail[data_parallel_rank].wait()
        error = EngineDeadError("the engine core process exited unexpectedly (killed by SIGKILL)")
        client.give_up(error)
        raise error


async def test_an_engine_failing_while_the_others_start_fails_the_start_up(monkeypatch) -> None:
    fakes = _FakeProcesses(2, loading={1})
    fakes.fail[0].set()
    monkeypatch.setattr(engine_fleet, "run_engine_process", fakes)
    lifecycle = supervisor.Lifecycle()
    with pytest.raises(BaseExceptionGroup) as raised, trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            config = ServerConfig(data_parallel_size=2)
            await nursery.start(supervisor.supervise_engines, config, lifecycle)
    assert raised.group_contains(EngineStartupError, match="engine core 0 failed during start-up")
    assert not lifecycle.stop_requested.is_set()  # never served: no "serving" line, exit 1


async def test_the_server_stops_when_the_last_engine_is_gone(monkeypatch) -> None:
    fakes = _FakeProcesses(2)
    monkeypatch.setattr(engine_fleet, "run_engine_process", fakes)
    lifecycle = supervisor.Lifecycle()
    async with trio.open_nursery() as nursery:
        config = ServerConfig(data_parallel_size=2)
        group = await nursery.start(supervisor.supervise_engines, config, lifecycle)
        assert isinstance(group, DataParallelClient)
        fakes.fail[1].set()
        await trio.testing.wait_all_tasks_blocked()
        assert not lifecycle.stop_requested.is_set()
        assert group.is_alive and group.num_serving == 1 and not group.ended.is_set()
        fakes.fail[0].set()
        await trio.testing.wait_all_tasks_blocked()
        assert lifecycle.stop_requested.is_set() and lifecycle.exit_code == 1
        assert lifecycle.reason.startswith("engine core 0 died: ")
        assert lifecycle.reason.endswith("(no engine left)")
        assert group.ended.is_set()


async def test_engines_start_together_with_the_dtype_given(monkeypatch) -> None:
    """``--dtype auto`` is decided by the CPU's flags, the same in every engine: no engine
    waits for another's choice (engine 1 starts while engine 0 still loads)."""
    fakes = _FakeProcesses(2, loading={0})
    monkeypatch.setattr(engine_fleet, "run_engine_process", fakes)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    async with trio.open_nursery() as nursery:
        config = ServerConfig(data_parallel_size=2)
        nursery.start_soon(supervisor.supervise_engines, config, supervisor.Lifecycle())
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(fakes.configs) == [0, 1]
        assert [fakes.configs[rank].model.dtype for rank in range(2)] == ["auto"] * 2
        nursery.cancel_scope.cancel()
