"""`EngineHandle`: what the request path uses of the engine, however many engines serve.

The API server and the supervisor talk to one handle: an
`trio_llm.frontend.engine_client.EngineClient` (one engine core; the embedding API's
`trio_llm.async_engine` always has one), or a
`trio_llm.frontend.data_parallel.DataParallelClient` routing over several. Both
implement this protocol (their shared code is `trio_llm.frontend.admission.
AdmissionControl`); a handler never needs to know which it has.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import trio

from trio_llm.errors import EngineError
from trio_llm.frontend.admission import Admission, Requests
from trio_llm.frontend.request_stream import RequestStream
from trio_llm.messages import DEFAULT_SCHEDULING, EngineReady, SamplingParams, Scheduling

if TYPE_CHECKING:
    from trio_llm.frontend.engine_client import EngineClient


class EngineHandle(Protocol):
    """The engine as the request path sees it.

    Attributes:
        draining: set by `close_admissions`: new requests are refused, open ones go on.
        stopping: set by `stop`.
        ended: set once no engine serves any more, for good (or `stop` was called).
    """

    draining: bool
    stopping: bool
    ended: trio.Event

    @property
    def info(self) -> EngineReady:
        """The (first) engine's `EngineReady`: model folder, context length, vocabulary."""
        ...

    @property
    def engines(self) -> list[EngineClient]:
        """The clients of the engine cores behind this handle, in rank order."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while an engine serves and the handle is not stopping."""
        ...

    @property
    def is_restarting(self) -> bool:
        """True while no engine serves and one is restarting (requests wait for it)."""
        ...

    @property
    def error(self) -> EngineError | None:
        """Why no engine serves, or None while one does."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests sent to an engine and not yet finished."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet."""
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
