"""`EngineHandle`: what the request path uses of the engine, however many engines serve.

The API server and the supervisor talk to one handle: an
`trio_llm.frontend.engine_client.EngineClient` (one engine core; the embedding API's
`trio_llm.async_engine` always has one), or a
`trio_llm.frontend.data_parallel.DataParallelClient` routing over several. Both
implement this protocol (their shared code is `trio_llm.frontend.admission.
AdmissionControl`); a handler never needs to know which it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import trio

from trio_llm.errors import EngineError
from trio_llm.frontend.admission import Admission, Requests
from trio_llm.frontend.request_stream import RequestStream
from trio_llm.messages import DEFAULT_SCHEDULING, EngineReady, SamplingParams, Scheduling

if TYPE_CHECKING:
    from trio_llm.frontend.engine_client import EngineClient


class EngineState(Protocol):
    """Whether engines serve, as every reader of that sees it: `EngineHandle` (one
    model's engines), the batch runner over a router's models
    (`trio_llm.api.model_router.RouterEngines`)."""

    @property
    def engines(self) -> Sequence[EngineClient]:
        """The clients of the engine cores behind this handle, in rank order."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while an engine serves and the handle is not stopping."""
        ...

    @property
    def ended(self) -> trio.Event:
        """Set once no engine serves any more, for good (or `stop` was called)."""
        ...

    @property
    def error(self) -> EngineError | None:
        """Why no engine serves, or None while one does."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet."""
        ...


class EngineHandle(EngineState, Protocol):
    """The engine as the request path sees it: its `EngineState`, and the way in.

    Attributes:
        draining: set by `close_admissions`: new requests are refused, open ones go on.
        stopping: set by `stop`.
    """

    draining: bool
    stopping: bool

    @property
    def info(self) -> EngineReady:
        """The (first) engine's `EngineReady`: model folder, context length, vocabulary."""
        ...

    @property
    def is_restarting(self) -> bool:
        """True while no engine serves and one is restarting (requests wait for it)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests sent to an engine and not yet finished."""
        ...

    def admit(self, count: int, limit: int | None) -> Admission:
        """Reserve ``count`` places among the waiting requests, or raise at once
        (`EngineOverloadedError` past ``limit``, or an `EngineError`)."""
        ...

    def release(self, admission: Admission) -> None:
        """Give back an `Admission` that was not used."""
        ...

    def close_admissions(self) -> None:
        """Start draining."""
        ...

    async def wait_idle(self) -> None:
        """Wait until no request is open or admitted."""
        ...

    def open_requests(
        self,
        requests: Requests,
        admission: Admission | None = None,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AbstractAsyncContextManager[list[RequestStream]]:
        """Submit requests (``(prompt_token_ids, params)`` each, all with ``scheduling``:
        their priority and lane); yield their streams. Leaving the block aborts the
        unfinished ones in the engine."""
        ...

    def open_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AbstractAsyncContextManager[RequestStream]:
        """Submit one request; yield its `RequestStream`."""
        ...

    async def stop(self, grace_period: float) -> None:
        """Fail open requests and stop every engine, giving each ``grace_period`` seconds."""
        ...
