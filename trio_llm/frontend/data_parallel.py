"""DataParallelClient: N engine cores behind the interface of one `EngineClient`
(`trio_llm.frontend.handle.EngineHandle`).

``--data-parallel-size N`` starts N engine-core children, each with its own model copy and
KV cache, each supervised by its own `trio_llm.frontend.engine_process.run_engine_process`
task in the server's nursery (the supervisor, `trio_llm.server.supervisor`). The API server
talks to them through this one handle, so the request path does not know how many
engines there are.

Routing. Each call of `DataParallelClient.open_requests` (one API request, all its
choices) goes to one engine:

1. Only serving engines are candidates; while none serves, a restarting one (the
   request waits for it as it would with one engine); with none left, the request fails.
2. With prefix caching on, the engine that most recently took the longest run of the
   prompt's leading KV blocks is preferred, unless it has `PREFIX_SLACK` more requests
   open than the least-loaded candidate. The record of what each engine took is
   `_PrefixRecord`: hashes of full blocks, as the engine's own prefix cache keys them,
   bounded by the engine's number of KV blocks (least recently routed dropped first). It
   approximates the engine's cache; a wrong guess only costs a cache miss.
3. Otherwise the least-loaded candidate (requests open or admitted), ties taken in turn.

A request that names its engine (vLLM's ``X-data-parallel-rank`` header,
`trio_llm.messages.Scheduling.data_parallel_rank`) goes to that one, serving or not.

Failure. Each engine fails and restarts on its own (``--engine-restart on-failure``):
only its in-flight requests fail. The handle serves while any engine does; `is_alive`
is False, and `ended` set, only when none is left.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import trio

from trio_llm.errors import EngineDeadError, EngineError, EngineShutdownError
from trio_llm.frontend.admission import Admission, AdmissionControl, Requests, Submit
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.request_stream import RequestStream
from trio_llm.messages import EngineReady, Scheduling

#: Open requests by which the engine holding a prompt's prefix may exceed the least-loaded
#: one and still be chosen for it.
PREFIX_SLACK = 4
#: Leading blocks of a prompt that are hashed for routing (longer shared prefixes route
#: the same way; the hashing stays bounded for long prompts).
MAX_ROUTED_BLOCKS = 256


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full ``block_size``-token blocks, first to last
    (at most `MAX_ROUTED_BLOCKS`): equal lists mean equal prefixes, as in the engine's
    prefix cache. Valid within this process only (Python's hash is salted per process)."""
    hashes: list[int] = []
    previous = 0
    end = min(len(token_ids) // block_size, MAX_ROUTED_BLOCKS) * block_size
    for start in range(0, end, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


class _PrefixRecord:
    """The block hashes recently routed to one engine, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` this engine took before."""
        count = 0
        for value in hashes:
            if value not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[int]) -> None:
        """Record ``hashes`` as the most recently used (dropping the oldest past capacity)."""
        for value in hashes:
            self._hashes[value] = None
            self._hashes.move_to_end(value)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the engine restarted with an empty cache)."""
        self._hashes.clear()


class DataParallelClient(AdmissionControl):
    """Routes requests over N `EngineClient` s; has the interface of one (see the module).

    Args:
        engines: one client per engine core, in rank order (each served by its own
            supervision task; the same client lives through that engine's restarts).
        prefix_aware: prefer the engine that took the prompt's prefix before (set it when
            the engines cache prefixes).
    """

    def __init__(self, engines: Sequence[EngineClient], *, prefix_aware: bool = True) -> None:
        if not engines:
            raise ValueError("a DataParallelClient needs at least one engine")
        self._engines = list(engines)
        self.prefix_aware = prefix_aware
        self._records = [_PrefixRecord(engine.info.num_kv_blocks) for engine in self._engines]
        self._restarts_seen = [engine.num_restarts for engine in self._engines]
        self._turn = itertools.count()
        self._init_admissions()
        #: `open_requests` blocks entered and not yet left.
        self._num_open_calls = 0
        self.stopping = False
        #: Set once no engine serves any more for good (each ended), or `stop` was called.
        self.ended = trio.Event()

    # ------------------------------------------------------------ state

    @property
    def engines(self) -> list[EngineClient]:
        """The engine clients, in rank order (the ``engine`` label of /metrics)."""
        return list(self._engines)

    @property
    def info(self) -> EngineReady:
        """The first engine's `EngineReady` (model, context length and vocabulary are the
        same for every engine)."""
        return self._engines[0].info

    @property
    def num_serving(self) -> int:
        """Engines serving now."""
        return sum(engine.is_alive for engine in self._engines)

    @property
    def is_alive(self) -> bool:
        """True while at least one engine serves and the client is not stopping."""
        return not self.stopping and self.num_serving > 0

    @property
    def is_restarting(self) -> bool:
        """True while no engine serves and at least one is restarting."""
        return not self.is_alive and any(e.is_restarting for e in self._engines)

    @property
    def error(self) -> EngineError | None:
        """None while an engine serves; else why not (a restarting engine's failure first)."""
        if self.is_alive:
            return None
        for engine in self._engines:
            if engine.is_restarting:
                return engine.error
        for engine in self._engines:
            if engine.error is not None:
                return engine.error
        return EngineShutdownError("the server is shutting down") if self.stopping else None

    @property
    def num_in_flight(self) -> int:
        """Requests sent to an engine and not yet finished, over all engines."""
        return sum(engine.num_in_flight for engine in self._engines)

    @property
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet, over all engines."""
        return self._num_reserved + sum(engine.num_waiting for engine in self._engines)

    def engine_ended(self) -> None:
        """An engine stopped for good (its supervision task calls this): `ended` is set
        once every engine has."""
        if all(engine.ended.is_set() for engine in self._engines):
            self.ended.set()

    # ------------------------------------------------------------ admission

    def _check_open(self) -> None:
        if self.stopping:
            raise EngineShutdownError("the server is shutting down")
        if not self._candidates():
            raise self.error or EngineDeadError("no engine core is serving")

    def _num_open(self) -> int:
        return self._num_open_calls

    # ------------------------------------------------------------ routing

    def _candidates(self) -> list[int]:
        """Ranks that may take a request: the serving ones, else the restarting ones."""
        serving = [rank for rank, engine in enumerate(self._engines) if engine.is_alive]
        if serving:
            return serving
        return [rank for rank, engine in enumerate(self._engines) if engine.is_restarting]

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The rank of the engine for a request with this prompt (see the module's rules);
        records the prompt's blocks as that engine's.

        Raises:
            EngineError: no engine serves or is restarting.
        """
        self._check_open()
        candidates = self._candidates()
        for rank in candidates:  # a restarted engine starts with an empty cache
            restarts = self._engines[rank].num_restarts
            if restarts != self._restarts_seen[rank]:
                self._restarts_seen[rank] = restarts
                self._records[rank].clear()
        loads = {rank: self._engines[rank].load for rank in candidates}
        least = min(loads.values())
        turn = next(self._turn)
        # Ties in load are taken in turn, so an idle fleet spreads its first requests.
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        chosen = min(rotated, key=loads.__getitem__)
        if not self.prefix_aware:
            return chosen
        hashes = prefix_block_hashes(prompt_token_ids, self.info.block_size)
        matched = {rank: self._records[rank].matched(hashes) for rank in candidates}
        best = max(matched.values())
        if best > 0 and len(candidates) > 1:
            holders = [rank for rank in rotated if matched[rank] == best]
            holder = min(holders, key=loads.__getitem__)
            if loads[holder] <= least + PREFIX_SLACK:
                chosen = holder
        self._records[chosen].add(hashes)
        return chosen

    def pin(self, prompt_token_ids: Sequence[int], rank: int) -> None:
        """Record a request the client sent to engine ``rank`` itself (vLLM's
        ``X-data-parallel-rank``): its prompt's blocks are that engine's from now on.

        Raises:
            EngineError: the server is stopping, or no engine serves.
            IndexError: no engine has this rank (checked before, at the header).
        """
        self._check_open()
        if self.prefix_aware:
            self._records[rank].add(prefix_block_hashes(prompt_token_ids, self.info.block_size))

    # ------------------------------------------------------------ requests

    async def _prepare(self, requests: Requests, scheduling: Scheduling) -> Submit:
        """Choose the engine (``scheduling.data_parallel_rank``'s, else `route` on the
        first prompt) and move the places to it (see `AdmissionControl.open_requests`).

        Raises:
            EngineError: no engine serves, or the chosen one is stopping or dead.
        """
        prompt = requests[0][0] if requests else []
        rank = scheduling.data_parallel_rank
        if rank is None:
            rank = self.route(prompt)
        else:
            self.pin(prompt, rank)
        engine = self._engines[rank]
        # The places move from this handle to the engine in one synchronous step.
        inner = engine.admit(len(requests), None)
        self._num_open_calls += 1
        self._busy()
        return partial(self._submit, engine, requests, inner)

    @asynccontextmanager
    async def _submit(
        self, engine: EngineClient, requests: Requests, inner: Admission, scheduling: Scheduling
    ) -> AsyncIterator[list[RequestStream]]:
        try:
            async with engine.open_requests(requests, inner, scheduling) as streams:
                yield streams
        finally:
            self._num_open_calls -= 1
            self._check_idle()

    # ------------------------------------------------------------ lifetime

    async def stop(self, grace_period: float) -> None:
        """Stop every engine at once (each as `EngineClient.stop`). Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        self.ended.set()
        async with trio.open_nursery() as nursery:
            for engine in self._engines:
                nursery.start_soon(engine.stop, grace_period)
