"""The models of the server (issue 35): every model of the catalog
(`trio_llm.server.model_catalog`), each run by its own engine children while loaded; `ModelPool`
is the app's `trio_llm.api.model_router.ModelRouter`.

Each loaded model is a task of the pool's nursery (`ModelPool.run`) that owns its engines
from start to stop: it makes room (`trio_llm.server.model_room`: ``--max-loaded-models``,
memory), starts the engines (`trio_llm.server.engine_fleet.run_model`; where models load on
demand, from a spare child with its imports done, `trio_llm.frontend.spare_engine`),
serves until unloaded (``POST /models/unload``), idle past its ``keep_alive``, evicted, or
its engines failed for good, then stops them. A request for a model not loaded starts its
load and waits (``--engine-restart-wait``, then 503); a model that failed to load answers
with the load error and is tried again after a backoff (at once by ``POST /models/load``).

The first (default) model loads before the server binds its port. On a server of one
model its engines failing for good stop the server (exit 1). On a server of several, a
model's failure is its own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import APIError, unknown_model
from trio_llm.api.model_router import (
    UNCHANGED,
    KeepAlive,
    Lease,
    ModelRouter,
    ModelStatus,
    model_unavailable,
)
from trio_llm.errors import EngineDeadError, EngineError, EngineStartupError, first_leaf
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.spare_engine import SpareEngine, spare_wanted
from trio_llm.server.engine_fleet import EngineOwner, run_model
from trio_llm.server.model_catalog import Catalog, CatalogEntry
from trio_llm.server.model_room import ModelRoom, PoolModel
from trio_llm.server_config import ServerConfig

logger = logging.getLogger(__name__)

#: Seconds before a model that failed to load is tried again by a request; doubling
#: with each failure in a row, up to `LOAD_RETRY_MAX`.
LOAD_RETRY_MIN = 5.0
LOAD_RETRY_MAX = 300.0

#: What runs a model's engines: `trio_llm.server.engine_fleet.run_model`'s signature (reports the
#: `ModelServing` once ready, returns once its engines stopped).
Starter = Callable[..., Awaitable[None]]


class _ModelFailure:
    """The `EngineOwner` of one model's engines on a server of several: their failure
    for good fails that model only."""

    def __init__(self, pool: ModelPool, model: PoolModel) -> None:
        self.pool = pool
        self.model = model

    def request_stop(self, reason: str, exit_code: int = 0, *, drain: bool = False) -> None:
        """The model's engines failed for good."""
        self.pool.engines_failed(self.model, reason)


class _ServerStop(_ModelFailure):
    """The `EngineOwner` of the engines of a server of one model: their failure stops
    the server (exit 1), as it always did."""

    def request_stop(self, reason: str, exit_code: int = 0, *, drain: bool = False) -> None:
        """The engines failed for good: so does the server."""
        serving = self.model.serving
        engine_error = serving.engine.error if serving is not None else None
        self.pool.server_failed(engine_error or EngineDeadError(reason))
        super().request_stop(reason, exit_code, drain=drain)
        self.pool.lifecycle.request_stop(reason, exit_code, drain=drain)


class ModelPool(ModelRouter):
    """The server's models (see the module doc).

    Args:
        config: the server's configuration (the default model's; each other model runs
            it with its own ``--model`` and names, `ServerConfig.for_model`).
        catalog: the models and their names.
        lifecycle: the server's stop (a server of one model stops when its engines fail).
        starter: runs a model's engines (`trio_llm.server.engine_fleet.run_model`; tests pass
            fakes).
        check_memory: check each model's memory need before its engines start (default:
            on a server of several models on the CPU).
    """

    def __init__(
        self,
        config: ServerConfig,
        catalog: Catalog,
        lifecycle: EngineOwner,
        *,
        starter: Starter = run_model,
        check_memory: bool | None = None,
    ) -> None:
        super().__init__(config.limits, config.request_body_timeout)
        self.config = config
        self.catalog = catalog
        self.lifecycle = lifecycle
        self.several = config.models.several
        self.store = None
        self._starter = starter
        if check_memory is None:
            check_memory = self.several and config.engine.model.device == "cpu"
        self._models: dict[CatalogEntry, PoolModel] = {}
        self._room = ModelRoom(config, self._models, self, check_memory)
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._ended = trio.Event()
        self._error: EngineError | None = None
        self._draining = False
        self._stopping = False
        self._stopped = trio.Event()
        self._listeners: list[Callable[[str, EngineHandle], None]] = []
        self._spare = SpareEngine() if starter is run_model and spare_wanted(config) else None

    @property
    def ended(self) -> trio.Event:
        return self._ended

    @property
    def error(self) -> EngineError | None:
        return self._error

    @property
    def stopping(self) -> bool:
        return self._draining or self._stopping

    def names(self) -> list[str]:
        return self.catalog.names()

    def statuses(self) -> list[ModelStatus]:
        statuses = []
        for entry in self.catalog.entries:
            model = self._models.get(entry) or PoolModel(entry, None)
            found = (model.state, model.serving, model.error)
            statuses.append(ModelStatus(entry.names, entry.root, entry.kind, *found))
        return statuses

    def engines(self) -> list[tuple[str, EngineHandle]]:
        models = self._models.values()
        return [(m.name, m.serving.engine) for m in models if m.serving is not None]

    def on_loaded(self, callback: Callable[[str, EngineHandle], None]) -> None:
        self._listeners.append(callback)
        for name, engine in self.engines():
            callback(name, engine)

    def notify(self) -> None:
        """Wake every task waiting for a model's state to change."""
        self._changed.set()
        self._changed = trio.Event()

    @property
    def changed_event(self) -> trio.Event:
        """The event the next `notify` sets."""
        return self._changed

    def _model_of(self, name: str | None, *, strict: bool = True) -> PoolModel:
        """The model ``name`` names (None: the default).

        Raises:
            APIError: 404 for a name the catalog does not have; a request to a server of
                one model (not ``strict``) goes to it instead, whose handlers answer the
                404 after checking the body, as they always did.
        """
        entry = self.catalog.default if name is None else self.catalog.get(name)
        if entry is None and ((not strict and not self.several) or self._is_adapter(name)):
            entry = self.catalog.default
        if entry is None:
            raise unknown_model(str(name), self.catalog.names())
        model = self._models.get(entry)
        if model is None:
            model = self._models[entry] = PoolModel(entry, self.config.models.keep_alive)
        return model

    def _is_adapter(self, name: str | None) -> bool:
        """Whether ``name`` is a LoRA adapter of the default model (loaded)."""
        model = self._models.get(self.catalog.default)
        serving = model.serving if model is not None else None
        return serving is not None and serving.adapters is not None and name in serving.adapters

    async def acquire(self, name: str | None, keep_alive: KeepAlive = UNCHANGED) -> Lease:
        model = self._model_of(name, strict=False)
        return await self._acquire(model, keep_alive, self.config.restart.wait)

    async def _acquire(self, model: PoolModel, keep_alive: KeepAlive, wait: float) -> Lease:
        """A lease on ``model``, loading it first if need be (waiting ``wait`` seconds)."""
        if keep_alive is not UNCHANGED:
            model.keep_alive = keep_alive  # type: ignore[assignment]
            self.notify()
        joined: int | None = None
        model.waiting += 1
        try:
            with trio.move_on_after(wait):
                while True:
                    event = self._changed
                    if model.state == "loaded" and not model.unload_requested:
                        serving = model.lease(trio.current_time())
                        return Lease(serving, partial(self._release, model))
                    if joined == model.attempt and model.state != "loading":
                        if model.attempt_error is not None:
                            raise model.attempt_error
                    if self.stopping:
                        raise model_unavailable("the server is shutting down", retry=False)
                    if model.state == "failed" and not model.may_retry(trio.current_time()):
                        raise model.failure or RuntimeError(f"{model.name} failed, no answer")
                    if model.state in ("unloaded", "failed"):
                        self._start(model)
                    if model.state == "loading" and joined is None:
                        joined = model.attempt
                    await event.wait()
        finally:
            model.waiting -= 1
            if not model.waiting:
                self.notify()  # a load waiting for room may give up
        raise model_unavailable(
            f"the model `{model.name}` did not load within {wait:g} s "
            "(--engine-restart-wait): retry later"
        )

    def _release(self, model: PoolModel) -> None:
        model.leases -= 1
        model.last_used = trio.current_time()
        self.notify()

    async def load(self, name: str, keep_alive: KeepAlive = UNCHANGED) -> None:
        model = self._model_of(name)
        if model.state == "failed":
            model.retry_at = trio.current_time()  # asked for: at once
        lease = await self._acquire(model, keep_alive, math.inf)
        lease.release()

    async def unload(self, name: str) -> None:
        model = self._model_of(name)
        if model.state == "failed":
            model.clear_failure()
            self.notify()
            return
        cycle = model.attempt
        if model.state in ("loading", "loaded"):
            logger.info(f"unloading the model {model.name} (asked)")
            model.unload_requested = True
            self.notify()
        while model.attempt == cycle and model.state in ("loading", "loaded", "unloading"):
            await self._changed.wait()

    async def reload(self) -> tuple[list[str], list[str]]:
        if self.catalog.models_dir is None:
            return [], []
        try:
            added, removed = await trio.to_thread.run_sync(self.catalog.rescan)
        except OSError as exc:
            raise APIError(500, f"--models-dir: {exc}", type="server_error") from None
        for entry in removed:
            model = self._models.get(entry)
            if model is None:
                continue
            if model.state in ("loading", "loaded"):
                model.unload_requested = True
            elif model.state != "unloading":
                del self._models[entry]
        self.notify()
        if added or removed:
            logger.info(
                f"--models-dir: {len(added)} models added, {len(removed)} removed "
                f"({', '.join(self.catalog.names())} served)"
            )
        return [entry.name for entry in added], [entry.name for entry in removed]

    def close_admissions(self) -> None:
        """Start draining: no model loads from now on, loaded ones admit no request."""
        self._draining = True
        for _, engine in self.engines():
            engine.close_admissions()
        self.notify()

    @property
    def num_in_flight(self) -> int:
        """Requests admitted by a loaded model's engines and not finished."""
        return sum(engine.num_in_flight for _, engine in self.engines())

    async def wait_idle(self) -> None:
        """Wait until no loaded model has a request open or admitted."""
        for _, engine in self.engines():
            await engine.wait_idle()

    async def stop(self, grace_period: float) -> None:
        """Stop every model's engines (each given ``grace_period`` seconds; a loading one
        at once) and end `run`. Idempotent."""
        self._stopping = True
        self._ended.set()
        self.notify()
        async with trio.open_nursery() as nursery:
            for model in list(self._models.values()):
                if model.serving is not None:
                    nursery.start_soon(model.serving.engine.stop, grace_period)
                elif model.scope is not None:
                    model.scope.cancel()
        self._stopped.set()

    def server_failed(self, error: EngineError) -> None:
        """The only model's engines failed for good (a server of one model): it stops."""
        if self._error is None:
            self._error = error
        self._ended.set()

    def engines_failed(self, model: PoolModel, reason: str) -> None:
        """``model``'s engines failed for good: it is unloaded and answers its requests
        with ``reason`` (until ``POST /models/load``)."""
        logger.error(f"the model {model.name} failed: {reason}")
        model.died = reason
        self.notify()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the models' tasks: load the default model, report ready, then run until
        `stop` (every model's engines gone).

        Raises:
            EngineStartupError: (inside an ExceptionGroup) the default model failed to
                load.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._spare is not None:  # models load on demand: an engine child waits
                nursery.start_soon(self._spare.run)
            default = self._model_of(None)
            default.begin()
            await nursery.start(self._model_task, default, True)
            task_status.started()
            await self._stopped.wait()
            if self._spare is not None:
                self._spare.close()

    def _start(self, model: PoolModel) -> None:
        """Start loading ``model`` (a task of the pool's nursery)."""
        if self._nursery is None:
            raise RuntimeError("a model is loaded only while the pool runs")
        model.begin()
        logger.info(f"loading the model {model.name}")
        self._nursery.start_soon(self._model_task, model, False)
        self.notify()

    async def _model_task(
        self,
        model: PoolModel,
        fatal: bool = False,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Load ``model``, serve it until it is to be unloaded, stop its engines.

        A failure to load is the model's (`PoolModel.failed`) unless ``fatal`` (the
        default model at start-up: raised, the server does not start).
        """
        model.scope = trio.CancelScope()
        if self._spare is not None:
            self._spare.install()  # this task's context: its engines may take the spare
        try:
            with model.scope:
                config = await self._room.take(model, fatal=fatal)
                await self._serve(model, config, task_status)
        except APIError as exc:  # no room now: the next request tries again
            if fatal:
                raise EngineStartupError(exc.message) from None
            model.attempt_error = exc
        except Exception as exc:
            if fatal:
                raise
            leaf = first_leaf(exc)
            retry = min(LOAD_RETRY_MAX, LOAD_RETRY_MIN * 2**model.load_failures)
            logger.error(
                f"the model {model.name} failed to load: {leaf} (tried again in {retry:g} s)"
            )
            model.failed("failed to load", str(leaf), trio.current_time() + retry)
            model.load_failures += 1
        finally:
            model.ended()
            if model.entry not in self.catalog.entries and model.state != "failed":
                self._models.pop(model.entry, None)
            self.notify()

    async def _serve(
        self, model: PoolModel, config: ServerConfig, task_status: trio.TaskStatus[None]
    ) -> None:
        """Run ``model``'s engines until it is to be unloaded (`_hold`), then stop them
        (after its open requests, up to ``--shutdown-timeout``)."""
        owner = _ModelFailure(self, model) if self.several else _ServerStop(self, model)
        name = model.name if self.several else None
        async with trio.open_nursery() as nursery:
            serving: ModelServing = await nursery.start(
                partial(self._starter, config, owner, model_name=name)
            )
            serving.store = self.store
            if self._draining:
                serving.engine.close_admissions()
            model.loaded(serving, trio.current_time())
            for callback in self._listeners:
                callback(model.name, serving.engine)
            if self.several:
                logger.info(f"the model {model.name} is loaded")
            self.notify()
            task_status.started()
            await self._hold(model)
            engine = serving.engine
            if model.died is None and not self._stopping:
                model.state = "unloading"
                self.notify()
                engine.close_admissions()
                with trio.move_on_after(self.config.shutdown_timeout):
                    await engine.wait_idle()
            await engine.stop(self.config.shutdown_timeout)
        if model.died is not None:
            model.failed(
                "its engines failed", model.died, None, "; POST /models/load loads it again"
            )
        elif self.several and not self._stopping:
            logger.info(f"the model {model.name} is unloaded")

    async def _hold(self, model: PoolModel) -> None:
        """Return once ``model`` is to be unloaded: asked (or evicted), idle past its
        ``keep_alive``, its engines failed, or the server stops."""
        while True:
            event = self._changed
            if model.died is not None or self._stopping or model.unload_requested:
                return
            if model.idle and model.keep_alive is not None:
                deadline = model.last_used + model.keep_alive
                if trio.current_time() >= deadline:
                    if self.several:
                        logger.info(
                            f"unloading the model {model.name}: idle for "
                            f"{model.keep_alive:g} s (keep_alive)"
                        )
                    return
                with trio.move_on_at(deadline):
                    await event.wait()
            else:
                await event.wait()
