"""Admission into an engine handle: the waiting line's places, draining, idleness.

A handler first reserves places (`AdmissionControl.admit`: refused at once when the
waiting line is full or the server drains), then turns them into engine requests
(``open_requests``); `AdmissionControl.wait_idle` lets a drain wait for the last one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from trio_llm.errors import EngineOverloadedError, EngineShutdownError
from trio_llm.messages import DEFAULT_SCHEDULING, SamplingParams, Scheduling

if TYPE_CHECKING:
    from trio_llm.frontend.request_stream import RequestStream

#: Requests to open together (the choices of one API request): ``(prompt_token_ids,
#: params)`` each.
Requests = Sequence[tuple[list[int], SamplingParams]]
#: What a handle's `AdmissionControl._prepare` returns: given the requests' `Scheduling`,
#: a context that sends them and yields their streams (aborting the unfinished on exit).
Submit = Callable[[Scheduling], AbstractAsyncContextManager[list["RequestStream"]]]


@dataclass
class Admission:
    """Places reserved in the waiting line by `EngineClient.admit` (see there)."""

    count: int
    released: bool = field(default=False)


class AdmissionControl(ABC):
    """The way in, shared by both engine handles (`trio_llm.frontend.engine_client.
    EngineClient` and `trio_llm.frontend.data_parallel.DataParallelClient`): places
    reserved in the waiting line by `admit` until `release`, draining
    (`close_admissions`), `wait_idle`, and `open_request` (one request, through the
    handle's `open_requests`).

    A subclass calls `_init_admissions` and defines `_check_open` (raise when no
    request can be served), `num_waiting`, `_num_open` (requests open now) and
    `_prepare` (its part of `open_requests`).
    """

    draining: bool
    _num_reserved: int
    _idle: trio.Event

    def _init_admissions(self) -> None:
        self.draining = False
        self._num_reserved = 0
        #: Set while no request is open or admitted (see `wait_idle`).
        self._idle = trio.Event()
        self._idle.set()

    @abstractmethod
    def _check_open(self) -> None: ...

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet."""

    @abstractmethod
    def _num_open(self) -> int: ...

    def admit(self, count: int, limit: int | None) -> Admission:
        """Reserve ``count`` places among the waiting requests, or refuse at once.

        Checking and reserving happen in one synchronous call, so concurrent handlers can
        never overshoot ``limit`` together. Hand the result to ``open_requests``, which
        turns it into real requests; `release` it if the requests are never opened.

        Raises:
            EngineOverloadedError: ``limit`` is set and would be exceeded.
            EngineError: no engine serves or will, the server is stopping, or it is
                draining.
        """
        self._check_open()
        if self.draining:
            raise EngineShutdownError("the server is shutting down")
        waiting = self.num_waiting
        if limit is not None and waiting + count > limit:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting (limit {limit}); retry later"
            )
        self._num_reserved += count
        self._busy()
        return Admission(count)

    def release(self, admission: Admission) -> None:
        """Give back an `Admission` that was not (or no longer needs to be) used."""
        if not admission.released:
            admission.released = True
            self._num_reserved -= admission.count
            self._check_idle()

    def close_admissions(self) -> None:
        """Start draining: `admit` refuses from now on; admitted and open requests go on."""
        self.draining = True
        self._check_idle()

    async def wait_idle(self) -> None:
        """Wait until no request is open or admitted (every accepted request has ended)."""
        self._check_idle()
        await self._idle.wait()

    def _check_idle(self) -> None:
        if self._num_open() == 0 and self._num_reserved == 0:
            self._idle.set()

    @asynccontextmanager
    async def open_requests(
        self,
        requests: Requests,
        admission: Admission | None = None,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AsyncIterator[list[RequestStream]]:
        """Submit requests (``(prompt_token_ids, params)`` each) and yield their streams.

        Leaving the block before a stream finished (an exception, a cancellation, a
        client that left, a stop string) aborts that request in the engine, which frees
        its KV blocks.

        Args:
            admission: places reserved with `admit`; consumed here (released once the
                handle's `_prepare` has opened the requests, which then count instead).
            scheduling: the priority and lane of every one of them (`Scheduling`).

        Raises:
            EngineError: no engine serves, the server is stopping (before anything is
                sent), or the engine is restarting and not ready in time.
        """
        try:
            if admission is None and self.draining:
                raise EngineShutdownError("the server is shutting down")
            submit = await self._prepare(requests, scheduling)
        finally:
            if admission is not None:
                self.release(admission)
        async with submit(scheduling) as streams:
            yield streams

    @abstractmethod
    async def _prepare(self, requests: Requests, scheduling: Scheduling) -> Submit:
        """The handle's own part of `open_requests` before the admission is released:
        count ``requests`` as open (synchronously, after its last checkpoint) and return
        what sends them and yields their streams (``scheduling``: as `open_requests`)."""

    @asynccontextmanager
    async def open_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> AsyncIterator[RequestStream]:
        """Submit one request and yield its `RequestStream` (see `open_requests`)."""
        requests = [(prompt_token_ids, params)]
        async with self.open_requests(requests, None, scheduling) as (stream,):
            yield stream

    def _busy(self) -> None:
        """A request was admitted or opened: not idle (waiters keep the same event)."""
        if self._idle.is_set():
            self._idle = trio.Event()
