"""EngineClient: the API server's handle on the engine core.

One reader task (`EngineClient.route_outputs`) receives every `StepOutputs` message and
hands each request's tokens to that request's mailbox; handlers consume them through
`EngineClient.open_request`. A mailbox coalesces tokens, so a slow consumer never blocks
the reader (and with it every other request). Once a mailbox holds
`PAUSE_AFTER_UNREAD_TOKENS` unread tokens beyond the ``stream_interval`` its consumer
waits for, the request is paused in the engine
(`PauseRequests`: it leaves the batch and frees its KV blocks) until its consumer reads
them (`ResumeRequests`), so a client that stops reading costs a bounded buffer here and
no batch slot there.

Timing (time to first token, inter-token latency, end-to-end latency) is measured here,
when outputs arrive, with this process's monotonic clock, and reported to an optional
`RequestObserver` (the Prometheus metrics). The queue time is measured by the engine
process with its own clock and shipped as a duration.

Liveness. The engine sends a `Heartbeat` every second from a task of its own, saying how
long the step under way has run; `route_outputs` also sends a `HealthCheck` every second
and the engine's main loop answers it between steps. The engine is hung when it is silent
for ``step_timeout`` seconds, when a step runs longer, or when a health check stays
unanswered that long while no step runs (its reader or its loop is stuck while its
heartbeats go on).

The client outlives the engine child it talks to when the supervisor restarts children
(``--engine-restart on-failure``): when a child dies or hangs, every open request fails at
once, new requests wait (up to ``restart_wait``) for the next child, which `attach`
connects. Draining (`close_admissions`, `wait_idle`) lets accepted requests finish while
new ones are refused.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from trio_llm import ipc
from trio_llm.errors import (
    EngineDeadError,
    EngineError,
    EngineHungError,
    EngineOverloadedError,
    EngineRestartingError,
    EngineShutdownError,
    RequestRejectedError,
)
from trio_llm.frontend.request_timing import EngineStats, RequestObserver, RequestRecord
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    FromEngine,
    HealthCheck,
    HealthReply,
    Heartbeat,
    PauseRequests,
    ResumeRequests,
    SamplingParams,
    Shutdown,
    StepOutputs,
    TokenLogprobs,
)

#: Engine request numbers, shared by every client in this process.
_REQUEST_IDS = itertools.count()

#: Unread output tokens, beyond a full piece of ``stream_interval`` tokens less one, after
#: which a request is paused in the engine (see the module doc): 64 with the default
#: interval of 1.
PAUSE_AFTER_UNREAD_TOKENS = 64

#: Seconds between the `HealthCheck` round trips through the engine's loop (at most; a
#: quarter of the step timeout when that is shorter).
HEALTH_CHECK_INTERVAL = 1.0

#: Without hang detection (no step timeout): seconds a health check may stay unanswered,
#: while no step runs, before the engine is reported unhealthy (``/health`` answers 503).
UNANSWERED_LIMIT = 60.0


@dataclass
class TokenDelta:
    """Output of one request that arrived since the consumer last looked.

    Attributes:
        token_ids: new output token ids, oldest first (may be empty on the final delta).
        finish_reason: None while running, else "stop", "length" or "abort".
        logprobs: one entry per new token when the request asked for logprobs, else None.
        prompt_logprobs: new prompt-position entries when asked for, else None.
        text: None when the API server detokenizes (inline mode). In 3-process mode the
            text the detokenizer child released for these tokens; ``logprobs`` are then
            those of the tokens behind that text, and ``stop_reason`` is set.
        stop_reason: with ``text``: the matched stop string or stop token id.
        embedding: an embedding model's vector, on the finishing delta.
        num_cached_tokens: on the request's first delta: prompt tokens that came from
            the prefix cache (`trio_llm.messages.RequestOutput.num_cached_tokens`).
    """

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    text: str | None = None
    stop_reason: str | int | None = None
    embedding: list[float] | None = None
    num_cached_tokens: int | None = None


class _Mailbox:
    __slots__ = (
        "embedding",
        "error",
        "finish_reason",
        "logprobs",
        "num_cached_tokens",
        "paused",
        "prompt_logprobs",
        "record",
        "started",
        "stop_reason",
        "text",
        "token_ids",
        "wakeup",
    )

    def __init__(self, record: RequestRecord) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.stop_reason: str | int | None = None
        self.embedding: list[float] | None = None
        self.num_cached_tokens: int | None = None
        self.error: EngineError | None = None
        self.wakeup = trio.Event()
        self.started = False
        self.paused = False
        self.record = record


@dataclass
class Admission:
    """Places reserved in the waiting line by `EngineClient.admit` (see there)."""

    count: int
    released: bool = field(default=False)


class AdmissionControl:
    """The waiting line's bookkeeping, shared by `EngineClient` and
    `trio_llm.frontend.data_parallel.DataParallelClient`: places reserved by `admit`
    until `release`, draining (`close_admissions`), and `wait_idle`.

    A subclass calls `_init_admissions` and defines `_check_open` (raise when no
    request can be served), `num_waiting` and `_num_open` (requests open now).
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

    def _check_open(self) -> None:
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet."""
        raise NotImplementedError

    def _num_open(self) -> int:
        raise NotImplementedError

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

    def _busy(self) -> None:
        """A request was admitted or opened: not idle (waiters keep the same event)."""
        if self._idle.is_set():
            self._idle = trio.Event()


class RequestStream:
    """Async iterator over one request's `TokenDelta`s; ends after the finishing delta.

    Raises:
        EngineError: the engine died, the server is shutting down, or the engine rejected
            the request — raised from ``__anext__`` as soon as it is known.
    """

    def __init__(self, request_id: str, mailbox: _Mailbox, client: EngineClient) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self._client = client
        self.finished = False
        self.finish_reason: str | None = None
        self._yielded = False

    async def finish(self, reason: str) -> None:
        """End the request early on the server's side (e.g. a stop string matched).

        The engine request is aborted at once (nothing more is delivered or counted),
        and it is counted as finished with ``reason`` rather than as aborted.
        """
        if self.finished:
            return
        self.finished = True
        self.finish_reason = reason
        await self._client._end_early(self.request_id, reason)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        box = self._mailbox
        if self.finished:
            raise StopAsyncIteration
        # The first delta as soon as there is one; later ones gather `stream_interval`
        # tokens (fewer at the end), as vLLM's --stream-interval.
        # The engine's first output for a request may come before its first token (the
        # request was scheduled: its prefix-cache hits are known); it is yielded at once
        # as a delta without tokens, and the first token still comes alone.
        needed = self._client.stream_interval if self._yielded else 1
        while (
            len(box.token_ids) < needed
            and not (needed == 1 and box.text)
            and box.finish_reason is None
            and box.error is None
            and box.num_cached_tokens is None
        ):
            await box.wakeup.wait()
            box.wakeup = trio.Event()
        self._yielded = self._yielded or bool(box.token_ids) or bool(box.text)
        if box.error is not None:
            self.finished = True
            raise box.error
        delta = TokenDelta(
            box.token_ids,
            box.finish_reason,
            box.logprobs,
            box.prompt_logprobs,
            box.text,
            box.stop_reason,
            box.embedding,
            box.num_cached_tokens,
        )
        box.num_cached_tokens = None
        box.token_ids = []
        box.logprobs = box.prompt_logprobs = None
        if box.text is not None:
            box.text = ""
        if delta.finish_reason is not None:
            self.finished = True
            self.finish_reason = delta.finish_reason
        elif box.paused:
            box.paused = False
            # Shielded: a consumer that goes on reading after a cancelled wait must not
            # find its request paused for ever.
            with trio.CancelScope(shield=True):
                await self._client._send_quietly(ResumeRequests([self.request_id]))
        return delta


class EngineClient(AdmissionControl):
    """Talks to the engine-core process over its IPC channel.

    Created by `trio_llm.frontend.engine_process.run_engine_process` once the engine said
    `EngineReady`; ``info`` holds that message. The process supervision there owns the
    children, their restarts and their cancel scopes; the client only serves requests
    through whichever child is attached, and tells the supervision when `stop` is called.

    States: *ready*; *restarting* (the child died or hung, in-flight requests failed, a
    new child is starting: new requests wait for it up to ``restart_wait`` seconds);
    *ended* for good (`ended` is set: the engine died without a restart, or `stop` was
    called). ``draining`` can be set in *ready*: new requests are refused, open ones go on.

    Args:
        channel: the IPC channel to the engine (or to the detokenizer in front of it).
        info: the engine's `EngineReady`.
        step_timeout: seconds without any message from the engine (heartbeats included),
            or a step running longer than this, after which the engine counts as hung.
            None disables hang detection.
        restart_wait: seconds a new request waits for a restarting engine before an
            `EngineRestartingError` (a 503). None: a failed child is not replaced, its
            failure ends the client for good.
        detokenizes: True in 3-process mode, where outputs arrive with their text
            (`TokenDelta.text`). Only reported (the client itself does not depend on it).
        on_stop: called by `stop` with the seconds the engine gets to exit, or None when
            no child is serving (whatever runs the children should end them now).
    """

    def __init__(
        self,
        channel: ipc.MessageChannel[FromEngine],
        info: EngineReady,
        *,
        step_timeout: float | None = None,
        restart_wait: float | None = None,
        detokenizes: bool = False,
        on_stop: Callable[[float | None], None] | None = None,
    ) -> None:
        self.info = info
        self.detokenizes = detokenizes
        #: Tokens each stream gathers before it yields a delta, after its first one
        #: (``--stream-interval``). A request is paused only past a full piece, so a
        #: reader that keeps up is never paused whatever the interval.
        self.stream_interval = 1
        self.stats = EngineStats()
        self.step_timeout = step_timeout
        #: A dead child will be replaced (requests then wait); off after `give_up`.
        self.restart_enabled = restart_wait is not None
        #: Seconds a new request waits for a restarting engine before a 503.
        self.restart_wait = restart_wait
        self._on_stop = on_stop
        #: Children started after the first one (for metrics).
        self.num_restarts = 0
        #: Times the engine was found hung (for metrics).
        self.num_hangs = 0
        #: Requests paused because their consumer left output unread (for metrics).
        self.num_pauses = 0
        self._channel = channel
        self._send_lock = trio.Lock()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._ids = _REQUEST_IDS  # unique across the clients of data-parallel engines
        self._prefix = f"{os.getpid()}-"
        self._error: EngineError | None = None
        self._ready = trio.Event()
        self._ready.set()
        self._init_admissions()
        self.stopping = False
        #: Set once the engine stopped serving for good (died, or `stop` was called).
        self.ended = trio.Event()
        self.observer: RequestObserver | None = None
        #: The last `HealthCheck` sent, and when (trio's clock; None once answered).
        self._health_seq = 0
        self._unanswered_since: float | None = None
        #: When the engine was last seen in or just after a step (trio's clock): an
        #: unanswered health check counts from then, since a step delays the answer.
        self._last_busy = -math.inf
        #: A health check has been unanswered for `UNANSWERED_LIMIT` (no hang detection).
        self._stalled = False
        #: The cancel scope of `route_outputs`' wait for the next message.
        self._receive_scope = trio.CancelScope()

    # ------------------------------------------------------------ state

    @property
    def is_alive(self) -> bool:
        """True while an engine child is serving (it answers health checks) and the client
        is not stopping."""
        return self._error is None and not self.stopping and not self._stalled

    @property
    def is_restarting(self) -> bool:
        """True between a child's failure and the next child's `attach` (when restarting)."""
        return self._error is not None and self.restart_enabled and not self.ended.is_set()

    @property
    def error(self) -> EngineError | None:
        """Why the engine is not serving (the last failure while restarting), if it is not."""
        if self._error is None and self._stalled:
            return EngineHungError(
                f"the engine core has left a health check unanswered for "
                f"{UNANSWERED_LIMIT:g} s while no step ran"
            )
        return self._error

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the engine and not yet finished."""
        return len(self._mailboxes)

    @property
    def load(self) -> int:
        """Requests open or admitted here: what data-parallel routing balances."""
        return len(self._mailboxes) + self._num_reserved

    @property
    def engines(self) -> list[EngineClient]:
        """The engine clients behind this handle: this one (see `DataParallelClient`)."""
        return [self]

    @property
    def num_waiting(self) -> int:
        """Requests admitted or sent that have produced no output yet (queued or prefilling)."""
        return self._num_reserved + sum(not box.started for box in self._mailboxes.values())

    def _check_open(self) -> None:
        if self.stopping:
            raise EngineShutdownError("the server is shutting down")
        if self._error is not None and not self.is_restarting:
            raise self._error

    async def _wait_ready(self) -> None:
        """Return once a child serves; raise if none will in time (see `open_requests`)."""
        self._check_open()
        if not self.is_restarting:
            return
        assert self.restart_wait is not None  # is_restarting implies restart_enabled
        with trio.move_on_after(self.restart_wait):
            await self._ready.wait()
        self._check_open()
        if self._error is not None:
            raise EngineRestartingError(
                f"the engine core is restarting after a failure ({self._error}); retry later"
            )

    def _num_open(self) -> int:
        return len(self._mailboxes)

    # ------------------------------------------------------------ requests

    @asynccontextmanager
    async def open_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestStream]:
        """Submit one request and yield its `RequestStream` (see `open_requests`)."""
        async with self.open_requests([(prompt_token_ids, params)]) as (stream,):
            yield stream

    @asynccontextmanager
    async def open_requests(
        self,
        requests: Sequence[tuple[list[int], SamplingParams]],
        admission: Admission | None = None,
    ) -> AsyncIterator[list[RequestStream]]:
        """Submit requests (``(prompt_token_ids, params)`` each) and yield their streams.

        Leaving the block before a stream finished (an exception, a cancellation, a
        client that left, a stop string) aborts that request in the engine, which frees
        its KV blocks; all of them go in one `AbortRequests` message.

        Args:
            admission: places reserved with `admit`; consumed here (released on exit).

        Raises:
            EngineError: the engine is dead or stopping (before anything is sent), or
                it is restarting and not ready within ``restart_wait`` seconds.
        """
        try:
            if admission is None and self.draining:
                raise EngineShutdownError("the server is shutting down")
            await self._wait_ready()
            now = time.monotonic()
            streams: list[RequestStream] = []
            for prompt_token_ids, _ in requests:
                request_id = f"{self._prefix}{next(self._ids)}"
                mailbox = _Mailbox(RequestRecord(len(prompt_token_ids), now))
                self._mailboxes[request_id] = mailbox
                streams.append(RequestStream(request_id, mailbox, self))
            if streams:
                self._busy()
        finally:
            if admission is not None:
                self.release(admission)  # the mailboxes now count as waiting
        # The choices of one API request share a group: the engine shares batch slots
        # fairly between groups, not between choices.
        group = streams[0].request_id if len(streams) > 1 else None
        try:
            for stream, (prompt_token_ids, params) in zip(streams, requests, strict=True):
                await self._send(AddRequest(stream.request_id, prompt_token_ids, params, group))
            yield streams
        finally:
            unfinished = []
            for stream in streams:
                mailbox = self._mailboxes.pop(stream.request_id, None)
                if mailbox is None:
                    continue
                unfinished.append(stream.request_id)
                self._finished(mailbox, stream.finish_reason or "abort")
            self._check_idle()
            if unfinished and self._error is None:
                with trio.CancelScope(shield=True):
                    await self._send_quietly(AbortRequests(unfinished))

    async def _end_early(self, request_id: str, reason: str) -> None:
        mailbox = self._mailboxes.pop(request_id, None)
        if mailbox is None:
            return
        self._finished(mailbox, reason)
        self._check_idle()
        if self._error is None:
            with trio.CancelScope(shield=True):
                await self._send_quietly(AbortRequests([request_id]))

    async def _send(
        self,
        message: AddRequest
        | AbortRequests
        | PauseRequests
        | ResumeRequests
        | HealthCheck
        | Shutdown,
    ) -> None:
        try:
            async with self._send_lock:
                await self._channel.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise self._error or EngineDeadError("the engine connection is closed") from exc

    async def _send_quietly(
        self, message: AbortRequests | PauseRequests | ResumeRequests | HealthCheck | Shutdown
    ) -> None:
        try:
            await self._send(message)
        except EngineError:
            pass  # the engine is gone: nothing left to abort or stop

    # ------------------------------------------------------------ routing

    async def route_outputs(self) -> None:
        """Deliver engine messages to request mailboxes until the channel ends or hangs.

        Meanwhile a task sends the health checks (see the module doc). On return the
        current child is considered gone: every open request got an error
        (`EngineHungError` when it stopped answering for ``step_timeout`` seconds), and
        the channel is closed, which also ends any write to it still under way.
        """
        self._unanswered_since = None
        self._stalled = False
        interval = min(HEALTH_CHECK_INTERVAL, self._unanswered_limit / 4)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_health_checks, interval)
                try:
                    await self._route()
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):
                        await self._channel.aclose()
        finally:
            self._stalled = False

    async def _route(self) -> None:
        """`route_outputs`' loop: returns once the child is gone, every request failed."""
        reason = "the engine core process exited unexpectedly"
        error_type: type[EngineDeadError] = EngineDeadError
        timeout = math.inf if self.step_timeout is None else self.step_timeout
        limit = self._unanswered_limit
        try:
            while True:
                heard = trio.current_time()
                deadline = heard + timeout
                if self._unanswered_since is not None and not self._stalled:
                    deadline = min(deadline, max(self._unanswered_since, self._last_busy) + limit)
                # `_send_health_checks` brings the deadline forward when it sends a check.
                with trio.move_on_at(deadline) as self._receive_scope:
                    message = await self._channel.receive()
                    if message is None:
                        break
                    if isinstance(message, StepOutputs):
                        self._last_busy = trio.current_time()
                        unread = self._deliver(message)
                        if unread and self._error is None:
                            await self._send_quietly(PauseRequests(unread))
                    elif isinstance(message, HealthReply):
                        if message.seq == self._health_seq:
                            self._unanswered_since = None
                            self._stalled = False
                    elif isinstance(message, EngineFailed):
                        reason = message.message
                    elif isinstance(message, Heartbeat):
                        if message.step_seconds > 0:
                            self._last_busy = trio.current_time()
                        if message.step_seconds > timeout:
                            seconds = message.step_seconds
                            reason = f"engine core hung: a step has run for {seconds:.1f} s"
                            error_type = EngineHungError
                            break
                    continue
                if trio.current_time() < heard + timeout:  # a health check went unanswered
                    if self.step_timeout is None:
                        self._stalled = True  # reported by /health; nothing is ended
                        continue
                    reason = (
                        f"engine core hung: its loop left a health check unanswered for "
                        f"{limit:g} s while no step ran"
                    )
                else:
                    reason = f"engine core hung: no heartbeat for {timeout:g} s"
                error_type = EngineHungError
                break
        except (trio.BrokenResourceError, trio.ClosedResourceError, ipc.ProtocolError) as exc:
            reason = f"the engine connection broke: {exc}"
        finally:
            if error_type is EngineHungError:
                self.num_hangs += 1
            if self._error is None:
                if self.stopping:
                    self.fail_all(EngineShutdownError("the server is shutting down"))
                else:
                    self.fail_all(error_type(reason))

    async def _send_health_checks(self, interval: float) -> None:
        """Every ``interval`` seconds, a `HealthCheck` unless the last one is unanswered."""
        while True:
            await trio.sleep(interval)
            if self._unanswered_since is None:
                self._health_seq += 1
                self._unanswered_since = now = trio.current_time()
                scope = self._receive_scope
                scope.deadline = min(scope.deadline, now + self._unanswered_limit)
                await self._send_quietly(HealthCheck(self._health_seq))

    @property
    def _unanswered_limit(self) -> float:
        """Seconds a health check may stay unanswered while no step runs."""
        return UNANSWERED_LIMIT if self.step_timeout is None else self.step_timeout

    def _deliver(self, message: StepOutputs) -> list[str]:
        """Hand each output to its mailbox; returns the ids of requests to pause (their
        consumer left `PAUSE_AFTER_UNREAD_TOKENS` or more tokens unread)."""
        to_pause: list[str] = []
        stats = self.stats
        step = message.stats
        stats.last = step
        if step.num_scheduled_reqs:
            stats.num_steps += 1
            stats.num_multi_request_steps += step.num_scheduled_reqs > 1
            stats.num_preemptions += step.num_preemptions
        now = time.monotonic()
        for output in message.outputs:
            box = self._mailboxes.get(output.request_id)
            if box is None:
                continue  # aborted by us already
            box.started = True
            record = box.record
            if output.queue_seconds is not None:
                record.queue_seconds = output.queue_seconds
            if output.num_cached_tokens is not None:
                box.num_cached_tokens = output.num_cached_tokens
            if output.error is not None:
                box.error = RequestRejectedError(output.error)
            if output.new_token_ids:
                self._count_tokens(record, len(output.new_token_ids), now)
                box.token_ids.extend(output.new_token_ids)
            if output.logprobs is not None:
                box.logprobs = (box.logprobs or []) + output.logprobs
            if output.prompt_logprobs is not None:
                box.prompt_logprobs = (box.prompt_logprobs or []) + output.prompt_logprobs
            if output.text is not None:
                box.text = (box.text or "") + output.text
                box.stop_reason = output.stop_reason
            if output.embedding is not None:
                box.embedding = output.embedding
            if output.finish_reason is not None:
                box.finish_reason = output.finish_reason
                del self._mailboxes[output.request_id]
                self._finished(box, output.finish_reason)
            elif not box.paused and len(box.token_ids) >= self._pause_after:
                box.paused = True
                self.num_pauses += 1
                to_pause.append(output.request_id)
            box.wakeup.set()
        return to_pause

    def _count_tokens(self, record: RequestRecord, count: int, now: float) -> None:
        previous = record.last_token_time
        record.num_output_tokens += count
        record.last_token_time = now
        if previous is None:
            record.first_token_seconds = now - record.arrival
            if self.observer is not None:
                self.observer.on_first_token(record)
            count -= 1  # the first token has no interval before it
            previous = now
        if count > 0 and self.observer is not None:
            self.observer.on_tokens(now - previous, count)

    def _finished(self, box: _Mailbox, reason: str) -> None:
        record = box.record
        record.finish_reason = reason
        record.e2e_seconds = time.monotonic() - record.arrival
        if self.observer is not None:
            self.observer.on_finished(record)

    def fail_all(self, error: EngineError) -> None:
        """End every open request with ``error``; later requests are refused with it too,
        or, with ``restart_enabled``, wait for the next child (see `attach`)."""
        self._error = error
        self._ready = trio.Event()
        if not self.restart_enabled or self.stopping:
            self.ended.set()
        for box in self._mailboxes.values():
            box.error = error
            box.wakeup.set()
            self._finished(box, "abort")
        self._mailboxes.clear()
        self._check_idle()

    def give_up(self, error: EngineError) -> None:
        """No child will be started any more: fail everything with ``error`` for good."""
        self.restart_enabled = False
        self.fail_all(error)

    @property
    def _pause_after(self) -> int:
        """Unread tokens at which a request is paused: `PAUSE_AFTER_UNREAD_TOKENS` past a
        full piece of `stream_interval` tokens (less one)."""
        return PAUSE_AFTER_UNREAD_TOKENS + self.stream_interval - 1

    def attach(self, channel: ipc.MessageChannel[FromEngine], info: EngineReady) -> None:
        """Serve through a restarted child from now on (requests waiting for it go ahead)."""
        self._channel = channel
        self._send_lock = trio.Lock()
        self.info = info
        self.num_restarts += 1
        self._error = None
        self._ready.set()

    # ------------------------------------------------------------ lifetime

    async def stop(self, grace_period: float) -> None:
        """Fail open requests, tell the engine to exit, and give it ``grace_period`` seconds.

        ``on_stop`` (see the class) learns the deadline: after it the process runner
        stops waiting and escalates (SIGTERM, then SIGKILL). Idempotent.
        """
        if self.stopping:
            return
        self.stopping = True
        self.ended.set()
        self._ready.set()  # requests waiting for a restart give up now
        if self._error is None:
            self.fail_all(EngineShutdownError("the server is shutting down"))
            # fail_all set _error; a Shutdown message still has to go out.
            try:
                async with self._send_lock:
                    await self._channel.send(Shutdown())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if self._on_stop is not None:
                self._on_stop(grace_period)
        elif self._on_stop is not None:
            self._on_stop(None)  # no child is serving: a restart (or its wait) ends now
