"""One model of the `trio_llm.server.model_pool.ModelPool` (`PoolModel`: its state, leases and
failures) and the room a model needs before its engines start (`ModelRoom`: a place under
``--max-loaded-models``, and memory).

Room is made by unloading idle models, least recently used first: never one with a lease
(a request holds it, `trio_llm.api.model_router.Lease`) or a request waiting for it.
Memory is checked against `trio_llm.server.model_memory`'s estimate; when no idle model is left
to unload, the KV cache is made smaller (down to `trio_llm.server.model_memory.MIN_KV_CACHE` per
engine), and a model that still does not fit is refused with a 503 naming what it needs
and what is available. A model that would not fit even with every idle model unloaded and
the smallest KV cache is refused at once, before anything is unloaded for it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Literal, NoReturn, Protocol

import trio

from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import APIError, without_host_paths
from trio_llm.api.model_router import model_unavailable
from trio_llm.server.model_catalog import CatalogEntry
from trio_llm.server.model_memory import (
    MARGIN,
    MIN_KV_CACHE,
    MemoryNeed,
    available_bytes,
    estimate,
    rss_bytes,
)
from trio_llm.server_config import ServerConfig

logger = logging.getLogger(__name__)

#: A pool model's state: `trio_llm.api.model_router.ModelState`, and ``unloading``
#: (its engines are stopping).
PoolState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


class PoolModel:
    """One model of the pool: its state, its handlers while loaded, who holds it.

    Attributes:
        entry: the catalog's entry.
        state: `PoolState`.
        serving: its handlers while loaded (and unloading).
        leases: leases held on it (requests in flight, before and after admission).
        waiting: requests waiting for it to load.
        last_used: when a lease on it was last taken or released (trio's clock).
        keep_alive: seconds it stays loaded when idle (None: forever).
        attempt: the number of its loads so far; `attempt_error` is the last one's error.
        error: why it failed (state ``failed``); failure: the answer to its requests then;
            retry_at: when a request may load it again (None: only ``POST /models/load``).
        load_failures: loads failed in a row (the backoff grows with them).
        unload_requested: it is to be unloaded (asked, evicted, removed from the folder).
        died: why its engines failed for good while loaded, else None.
        slot: it holds a place of ``--max-loaded-models``.
        need: its memory estimate while loading or loaded (on a memory-checked pool).
        scope: its task's cancel scope while the task runs.
    """

    def __init__(self, entry: CatalogEntry, keep_alive: float | None) -> None:
        self.entry = entry
        self.state: PoolState = "unloaded"
        self.serving: ModelServing | None = None
        self.leases = 0
        self.waiting = 0
        self.last_used = -math.inf
        self.keep_alive = keep_alive
        self.attempt = 0
        self.attempt_error: APIError | None = None
        self.error: str | None = None
        self.failure: APIError | None = None
        self.retry_at: float | None = None
        self.load_failures = 0
        self.unload_requested = False
        self.died: str | None = None
        self.slot = False
        self.need: MemoryNeed | None = None
        self.scope: trio.CancelScope | None = None

    @property
    def name(self) -> str:
        """Its first (listed) name."""
        return self.entry.name

    @property
    def idle(self) -> bool:
        """No lease held, no request waiting, nothing in flight in its engines."""
        if self.leases or self.waiting:
            return False
        return self.serving is None or self.serving.engine.num_in_flight == 0

    @property
    def leaving(self) -> bool:
        """Loaded, and to be unloaded or unloading: its memory comes free soon."""
        return self.state == "unloading" or (self.state == "loaded" and self.unload_requested)

    def begin(self) -> None:
        """A new load starts."""
        self.state = "loading"
        self.attempt += 1
        self.attempt_error = None
        self.error = None
        self.unload_requested = False
        self.died = None

    def loaded(self, serving: ModelServing, now: float) -> None:
        """The load succeeded: ``serving`` answers from now on."""
        self.serving = serving
        self.state = "loaded"
        self.last_used = now
        self.load_failures = 0
        self.failure = None
        self.retry_at = None

    def lease(self, now: float) -> ModelServing:
        """One more lease on the loaded model, taken at ``now``: its handlers.

        Raises:
            RuntimeError: it has no handlers (it is not loaded).
        """
        if self.serving is None:
            raise RuntimeError(f"{self.name} is leased without its handlers")
        self.leases += 1
        self.last_used = now
        return self.serving

    def failed(self, what: str, cause: str, retry_at: float | None, then: str = "") -> None:
        """It failed (to load, or its engines while loaded): until ``retry_at`` (None:
        until loaded on request) its requests get a 500 ``model_load_failed`` saying
        ``what``, the error's text ``cause`` and ``then``. ``cause`` names no host path
        (`trio_llm.api.http.errors.without_host_paths`: its own path becomes its name)."""
        model = self.entry.model
        paths = {model: f"`{self.name}`"} if "/" in model else {}
        if paths:
            paths[str(Path(model).expanduser().resolve())] = f"`{self.name}`"
        self.state = "failed"
        self.error = reason = f"{what}: {without_host_paths(cause, paths)}{then}"
        self.retry_at = retry_at
        self.failure = APIError(
            500,
            f"the model `{self.name}` {reason}",
            type="server_error",
            param="model",
            code="model_load_failed",
        )
        self.attempt_error = self.failure

    def may_retry(self, now: float) -> bool:
        """Whether a request may load it again now (state ``failed``)."""
        return self.retry_at is not None and now >= self.retry_at

    def clear_failure(self) -> None:
        """Forget a failure (``POST /models/unload`` of a failed model)."""
        self.state = "unloaded"
        self.error = None
        self.failure = None
        self.retry_at = None

    def ended(self) -> None:
        """Its task ended: nothing of its engines is left."""
        self.serving = None
        self.slot = False
        self.need = None
        self.scope = None
        if self.state != "failed":
            self.state = "unloaded"


class _Pool(Protocol):
    """What `ModelRoom` uses of `trio_llm.server.model_pool.ModelPool`."""

    several: bool

    @property
    def changed_event(self) -> trio.Event:
        """The event the next `notify` sets."""
        ...

    def notify(self) -> None:
        """Wake the tasks waiting for a model's state to change."""
        ...


class ModelRoom:
    """Makes room for a model before its engines start (see the module doc).

    Args:
        config: the server's configuration.
        models: the pool's models (shared, read as they change).
        pool: the pool (its `notify` and ``changed_event``).
        check_memory: check memory too (a server of several models on the CPU).
    """

    def __init__(
        self,
        config: ServerConfig,
        models: dict[CatalogEntry, PoolModel],
        pool: _Pool,
        check_memory: bool,
    ) -> None:
        self.config = config
        self.models = models
        self.pool = pool
        self.check_memory = check_memory

    async def take(self, model: PoolModel, *, fatal: bool = False) -> ServerConfig:
        """Room for ``model``: a place, then memory; its `ServerConfig` (the KV cache
        made smaller where memory is short).

        Raises:
            APIError: 503 when no place comes free within ``--engine-restart-wait`` or it
                does not fit in memory.
        """
        if not self.pool.several:
            model.slot = True
            return self.config
        entry = model.entry
        config = self.config.for_model(entry.model, entry.names)
        need = None
        if self.check_memory:
            engines = config.data_parallel_size
            need = await trio.to_thread.run_sync(estimate, config.engine, entry.kind, engines)
            model.need = need
            self._check_reachable(model, need)  # before a place is made: unload nothing
        await self._place(model, fatal)
        if need is not None:
            kv_cache = await self._fit(model, need)
            if kv_cache is not None:
                config = self.config.for_model(entry.model, entry.names, kv_cache)
        return config

    def idle_victim(self, exclude: PoolModel) -> PoolModel | None:
        """The least recently used idle loaded model other than ``exclude``, or None."""
        idle = [
            model
            for model in self.models.values()
            if model is not exclude
            and model.state == "loaded"
            and model.idle
            and not model.unload_requested
        ]
        return min(idle, key=lambda model: model.last_used, default=None)

    def _unload(self, victim: PoolModel, why: str) -> None:
        logger.info(f"unloading the model {victim.name}: {why}")
        victim.unload_requested = True
        self.pool.notify()

    async def _place(self, model: PoolModel, fatal: bool = False) -> None:
        """Wait for a place under ``--max-loaded-models`` (unloading the least recently
        used idle model), and take it.

        Raises:
            APIError: 503 once no request waits for the model any more (each waits
                ``--engine-restart-wait`` seconds).
        """
        limit = self.config.models.max_loaded_models
        while limit is not None:
            event = self.pool.changed_event
            taken = sum(other.slot for other in self.models.values() if other is not model)
            if taken < limit:
                break
            if not model.waiting and not fatal:
                raise model_unavailable(
                    f"the model `{model.name}` cannot load now: {limit} models are loaded "
                    "(--max-loaded-models) and none went idle; retry later"
                )
            victim = self.idle_victim(model)
            if victim is not None:
                self._unload(victim, f"least recently used (--max-loaded-models {limit})")
            await event.wait()
        model.slot = True

    def room(self, model: PoolModel) -> int | None:
        """Bytes of memory ``model`` may take: what the machine has available, less what
        the other loaded and loading models will take beyond what they hold now; None
        where the machine does not say."""
        available = available_bytes()
        if available is None:
            return None
        for other in self.models.values():
            if other is model:
                continue
            if other.serving is not None:
                engines = other.serving.engine.engines
                available += sum(rss_bytes(client.info.pid) for client in engines)
            if other.need is not None:
                available -= other.need.total
        return available

    async def _fit(self, model: PoolModel, need: MemoryNeed) -> int | None:
        """Make memory for ``model``, which needs ``need`` (unloading idle models); the
        KV cache size per engine to start it with (bytes), or None to keep the
        configured one.

        Raises:
            APIError: 503: it does not fit even with the smallest KV cache.
        """
        engines = need.engines
        while True:
            event = self.pool.changed_event
            room = self.room(model)
            if room is None or need.total + MARGIN <= room:
                return None
            self._check_reachable(model, need)
            victim = self.idle_victim(model)
            if victim is not None:
                self._unload(victim, f"the model {model.name} needs its memory")
            if victim is not None or any(m.leaving for m in self.models.values()):
                await event.wait()
                continue
            left = room - MARGIN - need.weights - need.overhead
            if need.kv_cache and left >= MIN_KV_CACHE * engines:
                kv_cache = left // engines
                model.need = replace(need, kv_cache=kv_cache * engines)
                logger.warning(
                    f"the model {model.name} gets a KV cache of {_gib(kv_cache)} GiB per "
                    f"engine instead of {_gib(need.kv_cache // engines)} (memory)"
                )
                return kv_cache
            self._refuse(model, need, room)

    def _check_reachable(self, model: PoolModel, need: MemoryNeed) -> None:
        """Refuse ``model`` at once, unloading nothing, when it would not fit even with
        every idle (or leaving) model unloaded and the smallest KV cache.

        Raises:
            APIError: 503, as `_refuse`.
        """
        room = self.room(model)
        if room is None:
            return
        freeable = sum(
            other.need.total
            for other in self.models.values()
            if other is not model
            and other.need is not None
            and (other.leaving or (other.state == "loaded" and other.idle))
        )
        smallest = (
            need.weights + need.overhead + (MIN_KV_CACHE * need.engines if need.kv_cache else 0)
        )
        if smallest + MARGIN > room + freeable:
            self._refuse(model, need, room + freeable)

    def _refuse(self, model: PoolModel, need: MemoryNeed, room: int) -> NoReturn:
        """Give up ``model``'s load: it needs more than ``room`` bytes.

        Raises:
            APIError: 503 naming what it needs and what is available.
        """
        model.need = None
        raise model_unavailable(
            f"the model `{model.name}` does not fit in memory: it needs about "
            f"{_gib(need.total)} GiB (weights {_gib(need.weights)}, KV cache "
            f"{_gib(need.kv_cache)}, engines {_gib(need.overhead)}) and "
            f"{_gib(max(0, room - MARGIN))} GiB can be made available; unload a model "
            "(POST /models/unload) or give a smaller --kv-cache-memory"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f}"
