"""Which model answers a request (issue 35): the `ModelRouter` the app asks for a model's
`ModelServing` by the request's ``model``, before the handler runs.

A generating or embedding route reads its body (`trio_llm.api.http.body_reading`), peeks at
``model`` and ``keep_alive`` (`peek_model`: one msgspec pass, no validation), then takes a
`Lease` on that model (`ModelRouter.acquire`: it may wait for the model to load) and
holds it until the response is over, its stream included: `LeaseReleaser`, an ASGI
middleware, releases every lease a request took once the app has answered it. A model
is never unloaded (evicted, or idle past its ``keep_alive``) while a lease on it is held.
The WebSocket's generations and background responses hold theirs with `ModelRouter.leased`.

A request without the API key (``/tokenize``, ``/detokenize``) changes nothing of the
models (`ModelRouter.acquire_for`): it gets a model loaded now, or a 503.

`OneModel` routes every request to one `ModelServing` (an app built around a ready
serving: the tests', ``trio-llm run-batch``'s); the server's router over several models
is `trio_llm.server.model_pool.ModelPool`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
import trio
from fastapi import Request
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.body_reading import read_body
from trio_llm.api.http.errors import APIError, bad_request, unknown_model
from trio_llm.api.http.middleware import key_presented
from trio_llm.api.http.parsing import INLINE_PARSE_BYTES, load_json, parse_body
from trio_llm.errors import EngineError
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.handle import EngineHandle
from trio_llm.server_config import RequestLimits, keep_alive_seconds
from trio_llm.store import Store

_Body = TypeVar("_Body", bound=BaseModel)

#: The ASGI scope key under which a request's leases wait for `LeaseReleaser`.
LEASES_SCOPE_KEY = "trio_llm.leases"

#: A model's state as ``/v1/models`` and ``/health`` report it (llama.cpp's words, and
#: ``unloading`` while its engines stop).
ModelState = Literal["loaded", "loading", "unloaded", "unloading", "failed"]


class _Unchanged:
    """`UNCHANGED`'s type."""

    def __repr__(self) -> str:
        return "UNCHANGED"


#: A request that does not set ``keep_alive`` leaves its model's as it is.
UNCHANGED = _Unchanged()

#: Seconds an idle model stays loaded (None: forever), or `UNCHANGED`.
KeepAlive = float | None | _Unchanged


@dataclass(frozen=True)
class ModelStatus:
    """One model of the server, as listed.

    Attributes:
        names: the names clients use in ``model``.
        model: its model card's ``root``: a named model's ``--model`` string (vLLM's),
            a local one's name (`trio_llm.server.model_catalog.CatalogEntry.root`).
        kind: ``gguf``, ``hf``, ``sentence-transformers``, ``cross-encoder`` or ``named``.
        state: `ModelState`.
        serving: its handlers while loaded, else None.
        error: why it failed (state ``failed``), else None.
    """

    names: tuple[str, ...]
    model: str
    kind: str
    state: ModelState
    serving: ModelServing | None = None
    error: str | None = None


class Lease:
    """A hold on a loaded model: its `serving` until `release` (idempotent)."""

    def __init__(self, serving: ModelServing, on_release: Callable[[], None] | None = None) -> None:
        self.serving = serving
        self._on_release = on_release

    def release(self) -> None:
        """Let the model go (it may be unloaded once no lease holds it)."""
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()


class ModelRouter(ABC):
    """The models an app serves, and the handlers of each (see the module doc).

    Attributes:
        several: whether the server may serve more than one model (``/health`` and the
            engine failures then speak per model).
        limits: the per-request limits (the same for every model).
        request_body_timeout: seconds a request body may take to arrive.
    """

    several = False

    def __init__(self, limits: RequestLimits, request_body_timeout: float) -> None:
        self.limits = limits
        self.request_body_timeout = request_body_timeout

    # The server's store (stored responses, conversations, files, batches; None with
    # ``--store-url none``).
    store: Store | None

    @property
    @abstractmethod
    def ended(self) -> trio.Event:
        """Set once the server's models stopped serving for good (its stop)."""

    @property
    @abstractmethod
    def error(self) -> EngineError | None:
        """Why the models stopped serving (an engine's death), if they did."""

    @abstractmethod
    def names(self) -> list[str]:
        """Every name a request may use, the default model's first."""

    @abstractmethod
    def statuses(self) -> list[ModelStatus]:
        """Every model, the default first."""

    @abstractmethod
    def engines(self) -> list[tuple[str, EngineHandle]]:
        """The engine handle of each loaded model, by its (first) name."""

    @abstractmethod
    def on_loaded(self, callback: Callable[[str, EngineHandle], None]) -> None:
        """Call ``callback(name, engine)`` for each model loaded now and from now on."""

    @abstractmethod
    async def acquire(self, name: str | None, keep_alive: KeepAlive = UNCHANGED) -> Lease:
        """A lease on model ``name`` (None: the default model), loaded first if need be;
        ``keep_alive`` (seconds; None: forever) becomes the model's from now on.

        Raises:
            APIError: 404 for a name the server does not serve; 503 (``Retry-After``)
                while it cannot load the model in time, or the server is stopping; the
                model's load error when it failed to load.
        """

    async def acquire_for(self, scope: Scope, name: str | None, keep_alive: KeepAlive) -> Lease:
        """The lease of the request of ``scope`` on model ``name``: `acquire`'s if it may
        change the models (`trio_llm.api.http.middleware.key_presented`), else `loaded`'s.

        Raises:
            APIError: as `acquire` or `loaded`; 401 naming ``keep_alive`` without the key.
        """
        if key_presented(scope):
            return await self.acquire(name, keep_alive)
        if keep_alive is not UNCHANGED:
            message = "keep_alive needs the API key (`Authorization: Bearer <key>`)"
            www = {"www-authenticate": "Bearer"}
            raise APIError(401, message, param="keep_alive", code="invalid_api_key", headers=www)
        return self.loaded(name)

    def loaded(self, name: str | None) -> Lease:
        """A lease on model ``name`` (None: the default) if it is loaded now, changing
        nothing: no load, no hold against unloading, no use counted (its idle time goes on).

        Raises:
            APIError: 404 for a name not served (as `acquire`); 503: not loaded now.
        """
        statuses = self.statuses()
        named = [status for status in statuses if name in status.names]
        if name is not None and not named and self.several:
            raise unknown_model(name, self.names())
        found = named[0] if named else statuses[0]
        if found.state != "loaded" or found.serving is None:
            raise model_unavailable(
                f"the model `{found.names[0]}` is not loaded, and a request without the API "
                "key loads no model: send the key, or ask again once it is loaded",
                retry=False,
            )
        return Lease(found.serving)

    @abstractmethod
    async def load(self, name: str, keep_alive: KeepAlive = UNCHANGED) -> None:
        """Load model ``name`` now (``POST /models/load``; a failed one is tried again),
        waiting as long as it takes; ``keep_alive`` as `acquire`'s.

        Raises:
            APIError: as `acquire`.
        """

    @abstractmethod
    async def unload(self, name: str) -> None:
        """Unload model ``name`` once its requests have ended (``POST /models/unload``).

        Raises:
            APIError: 404 for an unknown name; 400 where models cannot be unloaded.
        """

    @abstractmethod
    async def reload(self) -> tuple[list[str], list[str]]:
        """Read ``--models-dir`` again (``POST /models/reload``): the names of the models
        added and removed.

        Raises:
            APIError: 500 when the folder cannot be read.
        """

    @property
    @abstractmethod
    def stopping(self) -> bool:
        """True once the server stops taking requests (it drains or stops)."""

    async def parse(self, model: type[_Body], request: Request) -> _Body:
        """``request``'s body as ``model``, checked as every body is (the routes whose body
        names no model: no model's context length or vocabulary applies).

        Raises:
            APIError: as `trio_llm.api.chat.serving.ModelServing.parse`.
        """
        raw = await read_body(request, self.request_body_timeout)
        content_type = request.headers.get("content-type")
        return await parse_body(
            model, raw, content_type, self.limits, max_model_len=2**31, vocab_size=2**31
        )

    @asynccontextmanager
    async def leased(
        self, name: str | None, keep_alive: KeepAlive = UNCHANGED
    ) -> AsyncIterator[ModelServing]:
        """`acquire` as a context manager: the model's handlers, released on the way out."""
        lease = await self.acquire(name, keep_alive)
        try:
            yield lease.serving
        finally:
            lease.release()


class OneModel(ModelRouter):
    """The router of an app around one ready `ModelServing`: every request goes to it
    (``model`` is checked by the handlers, as ever), and it cannot be unloaded."""

    def __init__(self, serving: ModelServing) -> None:
        super().__init__(serving.limits, serving.request_body_timeout)
        self.serving = serving

    @property  # type: ignore[override]
    def store(self) -> Store | None:
        """The serving's store."""
        return self.serving.store

    @store.setter
    def store(self, store: Store | None) -> None:
        self.serving.store = store

    @property
    def ended(self) -> trio.Event:
        return self.serving.engine.ended

    @property
    def error(self) -> EngineError | None:
        return self.serving.engine.error

    @property
    def stopping(self) -> bool:
        return self.serving.engine.draining or self.serving.engine.stopping

    def names(self) -> list[str]:
        return list(self.serving.model_names)

    def statuses(self) -> list[ModelStatus]:
        info = self.serving.engine.info
        names = self.serving.model_names
        return [ModelStatus(names, info.model_dir, "hf", "loaded", self.serving)]

    def engines(self) -> list[tuple[str, EngineHandle]]:
        return [(self.serving.model_names[0], self.serving.engine)]

    def on_loaded(self, callback: Callable[[str, EngineHandle], None]) -> None:
        callback(self.serving.model_names[0], self.serving.engine)

    async def acquire(self, name: str | None, keep_alive: KeepAlive = UNCHANGED) -> Lease:
        return Lease(self.serving)

    async def load(self, name: str, keep_alive: KeepAlive = UNCHANGED) -> None:
        self.serving.resolve_model(name)

    async def unload(self, name: str) -> None:
        self.serving.resolve_model(name)
        raise bad_request("this server cannot unload its only model", "model")

    async def reload(self) -> tuple[list[str], list[str]]:
        return [], []


class RouterEngines:
    """What the batch runner reads of the engines (`trio_llm.api.batch.line_runner`), over
    every loaded model's: with one model, its engine handle's state; with several, the
    server's (a line whose model restarts or fails is answered 503 or 5xx, and retried).
    """

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    @property
    def engines(self) -> list[EngineClient]:
        """The engine clients of every loaded model."""
        return [client for _, handle in self.router.engines() for client in handle.engines]

    @property
    def is_alive(self) -> bool:
        """Whether requests can be served now."""
        handles = self.router.engines()
        if self.router.several or not handles:
            return not self.router.stopping and not self.router.ended.is_set()
        return handles[0][1].is_alive

    @property
    def ended(self) -> trio.Event:
        """Set once no model serves any more, for good."""
        return self.router.ended

    @property
    def error(self) -> EngineError | None:
        """Why no model serves any more."""
        return self.router.error

    @property
    def num_waiting(self) -> int:
        """Requests that wait for an engine, of every loaded model."""
        return sum(handle.num_waiting for _, handle in self.router.engines())


def as_router(target: ModelServing | ModelRouter) -> ModelRouter:
    """``target`` itself if it is a router, else a `OneModel` over it."""
    return target if isinstance(target, ModelRouter) else OneModel(target)


class _Peek(msgspec.Struct):
    """The two fields of a body that routing reads."""

    model: Any = None
    keep_alive: Any = msgspec.UNSET


_PEEK = msgspec.json.Decoder(_Peek)


def keep_alive_of(value: Any) -> KeepAlive:
    """A request's ``keep_alive`` field (Ollama's) in seconds; None: forever; `UNCHANGED`
    when absent (``msgspec.UNSET``) or null.

    Raises:
        APIError: 400 naming ``keep_alive`` for a value that is not a duration.
    """
    if value is msgspec.UNSET or value is None:
        return UNCHANGED
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise bad_request(str(exc), "keep_alive") from None


def _peek(body: bytes) -> tuple[str | None, KeepAlive]:
    try:
        peeked = _PEEK.decode(body)
        model, keep_alive = peeked.model, peeked.keep_alive
    except (msgspec.MsgspecError, RecursionError):
        # What msgspec refuses but the request parser reads (``NaN``, ``Infinity``, a
        # number past a double's range) routes by that parser's reading; what neither
        # reads (not JSON, nested too deeply) goes to the default model, whose parsing
        # names the error.
        try:
            value = load_json(body)
        except ValueError:
            return None, UNCHANGED
        if not isinstance(value, dict):
            return None, UNCHANGED
        model, keep_alive = value.get("model"), value.get("keep_alive", msgspec.UNSET)
    return (model if isinstance(model, str) else None), keep_alive_of(keep_alive)


async def peek_model(body: bytes) -> tuple[str | None, KeepAlive]:
    """The ``model`` (None when absent or not a string: the default model, whose parsing
    then names the error) and ``keep_alive`` of a JSON body (a large one read in a worker
    thread).

    Raises:
        APIError: 400 naming ``keep_alive`` for a value that is not a duration.
    """
    if len(body) > INLINE_PARSE_BYTES:
        return await trio.to_thread.run_sync(_peek, body)
    return _peek(body)


def hold(scope: Scope, lease: Lease) -> None:
    """Keep ``lease`` until the app has answered the request of ``scope`` (`LeaseReleaser`)."""
    scope.setdefault(LEASES_SCOPE_KEY, []).append(lease)


def routed_model_name(scope: Scope) -> str | None:
    """The first name of the model that answered the request of ``scope`` (the one its
    lease held, `hold`), or None when no model did (a refusal before routing, a route
    that needs none)."""
    leases: list[Lease] = scope.get(LEASES_SCOPE_KEY) or []
    return leases[0].serving.model_names[0] if leases else None


class LeaseReleaser:
    """ASGI middleware: release the leases a request took (`hold`) once the app has
    answered it, its stream included, however it ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, then release its leases."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Lease] = scope.setdefault(LEASES_SCOPE_KEY, [])
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()


def model_unavailable(message: str, *, retry: bool = True) -> APIError:
    """The 503 of a model that cannot serve now (loading too long, no room, stopping)."""
    headers = {"Retry-After": "1"} if retry else None
    return APIError(
        503, message, type="service_unavailable_error", code="model_unavailable", headers=headers
    )
