"""EngineClient: the API server's handle on the engine core.

One reader task (`EngineClient.route_outputs`) receives every `StepOutputs` message and
hands each request's tokens to that request's mailbox; handlers consume them through
`EngineClient.open_request`. A mailbox coalesces tokens, so a slow consumer never blocks
the reader (and with it every other request); it holds at most the request's own output.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from trio_llm import ipc
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    FromEngine,
    SamplingParams,
    Shutdown,
    StepOutputs,
    StepStats,
)


class EngineError(Exception):
    """A request cannot be served by the engine (base class)."""


class EngineDeadError(EngineError):
    """The engine core process has exited or failed; nothing more will be generated."""


class EngineShutdownError(EngineError):
    """The server is shutting down; in-flight requests are ended with this."""


class RequestRejectedError(EngineError):
    """The engine refused this one request (the message says why); others are unaffected."""


@dataclass
class TokenDelta:
    """Tokens of one request that arrived since the consumer last looked.

    Attributes:
        token_ids: new output token ids, oldest first (may be empty on the final delta).
        finish_reason: None while running, else "stop", "length" or "abort".
    """

    token_ids: list[int]
    finish_reason: str | None = None


class _Mailbox:
    __slots__ = ("error", "finish_reason", "token_ids", "wakeup")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: EngineError | None = None
        self.wakeup = trio.Event()


class RequestStream:
    """Async iterator over one request's `TokenDelta`s; ends after the finishing delta.

    Raises:
        EngineError: the engine died, the server is shutting down, or the engine rejected
            the request — raised from ``__anext__`` as soon as it is known.
    """

    def __init__(self, request_id: str, mailbox: _Mailbox) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        box = self._mailbox
        if self.finished:
            raise StopAsyncIteration
        while not box.token_ids and box.finish_reason is None and box.error is None:
            await box.wakeup.wait()
            box.wakeup = trio.Event()
        if box.error is not None:
            self.finished = True
            raise box.error
        delta = TokenDelta(box.token_ids, box.finish_reason)
        box.token_ids = []
        if delta.finish_reason is not None:
            self.finished = True
        return delta


@dataclass
class EngineStats:
    """Counters kept from the engine's per-step stats (read by tests, benchmarks, metrics)."""

    num_steps: int = 0
    num_multi_request_steps: int = 0
    num_preemptions: int = 0
    last: StepStats | None = None


class EngineClient:
    """Talks to one engine-core process over its IPC channel.

    Created by `trio_llm.frontend.engine_process.run_engine_process` once the engine said
    `EngineReady`; ``info`` holds that message.
    """

    def __init__(self, channel: ipc.MessageChannel[FromEngine], info: EngineReady) -> None:
        self.info = info
        self.stats = EngineStats()
        self._channel = channel
        self._send_lock = trio.Lock()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-"
        self._error: EngineError | None = None
        self.stopping = False
        self.stop_scope = trio.CancelScope()

    # ------------------------------------------------------------ state

    @property
    def is_alive(self) -> bool:
        """True until the engine dies or the client is stopped."""
        return self._error is None and not self.stopping

    @property
    def error(self) -> EngineError | None:
        """Why the engine stopped serving, once it has."""
        return self._error

    @property
    def num_in_flight(self) -> int:
        """Requests sent to the engine and not yet finished."""
        return len(self._mailboxes)

    # ------------------------------------------------------------ requests

    @asynccontextmanager
    async def open_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestStream]:
        """Submit a request and yield its `RequestStream`.

        Leaving the block before the stream finished (an exception, a cancellation, a
        client that left) aborts the request in the engine, which frees its KV blocks.

        Raises:
            EngineError: the engine is dead or stopping (before anything is sent).
        """
        if self._error is not None:
            raise self._error
        if self.stopping:
            raise EngineShutdownError("the server is shutting down")
        request_id = f"{self._prefix}{next(self._ids)}"
        mailbox = _Mailbox()
        self._mailboxes[request_id] = mailbox
        stream = RequestStream(request_id, mailbox)
        try:
            await self._send(AddRequest(request_id, prompt_token_ids, params))
            yield stream
        finally:
            if self._mailboxes.pop(request_id, None) is not None and self._error is None:
                with trio.CancelScope(shield=True):
                    await self._send_quietly(AbortRequests([request_id]))

    async def _send(self, message: AddRequest | AbortRequests | Shutdown) -> None:
        try:
            async with self._send_lock:
                await self._channel.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise self._error or EngineDeadError("the engine connection is closed") from exc

    async def _send_quietly(self, message: AbortRequests | Shutdown) -> None:
        try:
            await self._send(message)
        except EngineError:
            pass  # the engine is gone: nothing left to abort or stop

    # ------------------------------------------------------------ routing

    async def route_outputs(self) -> None:
        """Deliver engine messages to request mailboxes until the channel ends.

        On return the engine is considered dead: every open request got an error.
        """
        reason = "the engine core process exited unexpectedly"
        try:
            while (message := await self._channel.receive()) is not None:
                if isinstance(message, StepOutputs):
                    self._deliver(message)
                elif isinstance(message, EngineFailed):
                    reason = message.message
        except (trio.BrokenResourceError, trio.ClosedResourceError, ipc.ProtocolError) as exc:
            reason = f"the engine connection broke: {exc}"
        finally:
            if self._error is None:
                if self.stopping:
                    self.fail_all(EngineShutdownError("the server is shutting down"))
                else:
                    self.fail_all(EngineDeadError(reason))

    def _deliver(self, message: StepOutputs) -> None:
        stats = self.stats
        step = message.stats
        stats.last = step
        if step.num_scheduled_reqs:
            stats.num_steps += 1
            stats.num_multi_request_steps += step.num_scheduled_reqs > 1
            stats.num_preemptions += step.num_preemptions
        for output in message.outputs:
            box = self._mailboxes.get(output.request_id)
            if box is None:
                continue  # aborted by us already
            if output.error is not None:
                box.error = RequestRejectedError(output.error)
            box.token_ids.extend(output.new_token_ids)
            if output.finish_reason is not None:
                box.finish_reason = output.finish_reason
                del self._mailboxes[output.request_id]
            box.wakeup.set()

    def fail_all(self, error: EngineError) -> None:
        """End every open request with ``error``; later requests are refused with it too."""
        self._error = error
        for box in self._mailboxes.values():
            box.error = error
            box.wakeup.set()
        self._mailboxes.clear()

    # ------------------------------------------------------------ lifetime

    async def stop(self, grace_period: float) -> None:
        """Fail open requests, tell the engine to exit, and give it ``grace_period`` seconds.

        After the deadline the process runner stops waiting and escalates (SIGTERM, then
        SIGKILL). Idempotent.
        """
        if self.stopping:
            return
        self.stopping = True
        if self._error is None:
            self.fail_all(EngineShutdownError("the server is shutting down"))
            # fail_all set _error; a Shutdown message still has to go out.
            try:
                async with self._send_lock:
                    await self._channel.send(Shutdown())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self.stop_scope.deadline = min(self.stop_scope.deadline, trio.current_time() + grace_period)
