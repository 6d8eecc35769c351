"""EngineClient: the API server's handle on one engine core.

One reader task (`EngineClient.route_outputs`) hands each request's outputs to its
mailbox (`trio_llm.frontend.request_stream`), timing them as they arrive
(`trio_llm.frontend.request_timing`), and watches the engine's liveness
(`trio_llm.frontend.liveness`); handlers consume them through `open_requests`. Once a
mailbox holds `PAUSE_AFTER_UNREAD_TOKENS` unread tokens beyond the ``stream_interval``
its consumer waits for, the request is paused in the engine (`PauseRequests`: it leaves
the batch and frees its KV blocks) until its consumer reads them (`ResumeRequests`), so
a client that stops reading costs a bounded buffer here and no batch slot there.

The client outlives the engine child it talks to when the supervisor restarts children
(``--engine-restart on-failure``): when a child dies or hangs, every open request fails at
once, new requests wait (up to ``restart_wait``) for the next child, which `attach`
connects. Draining (`close_admissions`, `wait_idle`) lets accepted requests finish while
new ones are refused.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import trio

from trio_llm import ipc, messages
from trio_llm.errors import (
    EngineDeadError,
    EngineError,
    EngineHungError,
    EngineRestartingError,
    EngineShutdownError,
)
from trio_llm.frontend.admission import AdmissionControl, Requests, Submit
from trio_llm.frontend.liveness import HealthWatch
from trio_llm.frontend.request_stream import Mailbox, RequestStream, deliver
from trio_llm.frontend.request_timing import (
    EngineStats,
    RequestObserver,
    RequestRecord,
    record_finished,
)
from trio_llm.messages import (
    AddRequest,
    EngineFailed,
    EngineReady,
    FromEngine,
    HealthReply,
    Heartbeat,
    Scheduling,
    StepOutputs,
    ToEngine,
)

#: Engine request numbers, shared by every client in this process.
_REQUEST_IDS = itertools.count()

#: Unread output tokens, beyond a full piece of ``stream_interval`` tokens less one, after
#: which a request is paused in the engine (see the module doc): 64 with the default
#: interval of 1.
PAUSE_AFTER_UNREAD_TOKENS = 64


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
        self._mailboxes: dict[str, Mailbox] = {}
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
        self._health = HealthWatch(step_timeout)

    # ------------------------------------------------------------ state

    @property
    def is_alive(self) -> bool:
        """True while an engine child is serving (it answers health checks) and the client
        is not stopping."""
        return self._error is None and not self.stopping and not self._health.stalled

    @property
    def is_restarting(self) -> bool:
        """True between a child's failure and the next child's `attach` (when restarting)."""
        return self._error is not None and self.restart_enabled and not self.ended.is_set()

    @property
    def error(self) -> EngineError | None:
        """Why the engine is not serving (the last failure while restarting), if it is not."""
        if self._error is None and self._health.stalled:
            return self._health.stalled_error()
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
        if self.restart_wait is None:
            raise RuntimeError("restarting without a restart policy")
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

    async def _prepare(self, requests: Requests, scheduling: Scheduling) -> Submit:
        """Wait until the engine serves, then open a mailbox for each request (see
        `AdmissionControl.open_requests`).

        Raises:
            EngineError: the engine is dead or stopping, or it is restarting and not
                ready within ``restart_wait`` seconds.
        """
        await self._wait_ready()
        now = time.monotonic()
        streams: list[RequestStream] = []
        for prompt_token_ids, _ in requests:
            request_id = f"{self._prefix}{next(self._ids)}"
            mailbox = Mailbox(RequestRecord(len(prompt_token_ids), now))
            self._mailboxes[request_id] = mailbox
            streams.append(RequestStream(request_id, mailbox, self))
        if streams:
            self._busy()
        return partial(self._submit, requests, streams)

    @asynccontextmanager
    async def _submit(
        self, requests: Requests, streams: list[RequestStream], scheduling: Scheduling
    ) -> AsyncIterator[list[RequestStream]]:
        """Send the `AddRequest` of each of ``streams``, yield them; on exit abort the
        unfinished ones, all in one `AbortRequests` message."""
        # The choices of one API request share a group: the engine shares batch slots
        # fairly between groups, not between choices.
        group = streams[0].request_id if len(streams) > 1 else None
        try:
            for stream, (prompt_token_ids, params) in zip(streams, requests, strict=True):
                message = AddRequest(stream.request_id, prompt_token_ids, params, group, scheduling)
                await self._send(message)
            yield streams
        finally:
            await self._abort([(s.request_id, s.finish_reason or "abort") for s in streams])

    async def _abort(self, ends: list[tuple[str, str]]) -> None:
        """End requests here, each ``(request_id, reason)`` counted as finished with its
        reason, and abort the ones still open in the engine (in one shielded message)."""
        unfinished = []
        for request_id, reason in ends:
            mailbox = self._mailboxes.pop(request_id, None)
            if mailbox is not None:
                unfinished.append(request_id)
                record_finished(mailbox.record, reason, self.observer)
        self._check_idle()
        if unfinished and self._error is None:
            with trio.CancelScope(shield=True):
                await self._send_quietly(messages.AbortRequests(unfinished))

    async def _resume(self, request_id: str) -> None:
        await self._send_quietly(messages.ResumeRequests([request_id]))

    async def _send(self, message: ToEngine) -> None:
        try:
            async with self._send_lock:
                await self._channel.send(message)
        except ipc.CHANNEL_CLOSED as exc:
            raise self._error or EngineDeadError("the engine connection is closed") from exc

    async def _send_quietly(self, message: ToEngine) -> None:
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
        self._health.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._health.send_checks, self._send_quietly)
                try:
                    await self._route()
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):
                        await self._channel.aclose()
        finally:
            self._health.stalled = False

    async def _route(self) -> None:
        """`route_outputs`' loop: returns once the child is gone, every request failed."""
        reason = "the engine core process exited unexpectedly"
        error_type: type[EngineDeadError] = EngineDeadError
        watch = self._health
        try:
            while True:
                heard = trio.current_time()
                with trio.move_on_at(watch.receive_deadline(heard)) as watch.receive_scope:
                    message = await self._channel.receive()
                    if message is None:
                        break
                    if isinstance(message, StepOutputs):
                        watch.busy()
                        unread = self._deliver(message)
                        if unread and self._error is None:
                            await self._send_quietly(messages.PauseRequests(unread))
                    elif isinstance(message, HealthReply):
                        watch.answered(message.seq)
                    elif isinstance(message, EngineFailed):
                        reason = message.message
                    elif isinstance(message, Heartbeat) and (hang := watch.heartbeat(message)):
                        reason, error_type = hang, EngineHungError
                        break
                    continue
                hang = watch.silence(heard)
                if hang is None:
                    continue  # reported by /health; nothing is ended
                reason, error_type = hang, EngineHungError
                break
        except ipc.CHANNEL_BROKEN as exc:
            reason = f"the engine connection broke: {exc}"
        finally:
            if error_type is EngineHungError:
                self.num_hangs += 1
            if self._error is None:
                stopped = EngineShutdownError("the server is shutting down")
                self.fail_all(stopped if self.stopping else error_type(reason))

    def _deliver(self, message: StepOutputs) -> list[str]:
        """Hand each output to its mailbox; returns the ids of requests to pause (their
        consumer left `PAUSE_AFTER_UNREAD_TOKENS` or more tokens unread)."""
        self.stats.add_step(message.stats)
        pause_after = PAUSE_AFTER_UNREAD_TOKENS + self.stream_interval - 1  # past a piece
        to_pause = deliver(self._mailboxes, message.outputs, pause_after, self.observer)
        self.num_pauses += len(to_pause)
        return to_pause

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
            record_finished(box.record, "abort", self.observer)
        self._mailboxes.clear()
        self._check_idle()

    def give_up(self, error: EngineError) -> None:
        """No child will be started any more: fail everything with ``error`` for good."""
        self.restart_enabled = False
        self.fail_all(error)

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
            with contextlib.suppress(*ipc.CHANNEL_CLOSED):
                async with self._send_lock:
                    await self._channel.send(messages.Shutdown())
            if self._on_stop is not None:
                self._on_stop(grace_period)
        elif self._on_stop is not None:
            self._on_stop(None)  # no child is serving: a restart (or its wait) ends now
