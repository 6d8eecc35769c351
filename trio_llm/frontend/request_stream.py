"""One engine request's output on the API server's side: its `Mailbox` and `RequestStream`.

The engine handle's reader task puts each request's outputs into that request's mailbox
(`deliver`) and wakes its consumer; the consumer iterates the `RequestStream`, which
takes what gathered as one `TokenDelta` (`Mailbox.take_delta`). A mailbox coalesces
tokens, so a slow consumer never blocks the reader (and with it every other request);
the handle pauses a request whose consumer leaves too much unread, and the stream
resumes it once its consumer reads again (see `trio_llm.frontend.engine_client`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from trio_llm.errors import EngineError, RequestRejectedError
from trio_llm.frontend.request_timing import (
    RequestObserver,
    RequestRecord,
    count_tokens,
    record_finished,
)
from trio_llm.messages import RequestOutput, TokenLogprobs
from trio_llm.text.token_delta import TokenDelta


class Mailbox:
    """What arrived for one request and its consumer has not taken yet.

    Args:
        record: the request's timing record (for metrics).
    """

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
        #: The engine sent some output for it (it is no longer waiting).
        self.started = False
        #: Paused in the engine until its consumer reads.
        self.paused = False
        self.record = record

    def add(self, output: RequestOutput) -> None:
        """Gather one engine output (the consumer is not woken here)."""
        self.started = True
        if output.queue_seconds is not None:
            self.record.queue_seconds = output.queue_seconds
        if output.num_cached_tokens is not None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.error is not None:
            self.error = RequestRejectedError(output.error)
        self.token_ids.extend(output.new_token_ids)
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + output.logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + output.prompt_logprobs
        if output.text is not None:
            self.text = (self.text or "") + output.text
            self.stop_reason = output.stop_reason
        if output.embedding is not None:
            self.embedding = output.embedding
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason

    def take_delta(self) -> TokenDelta:
        """Everything gathered, as one delta; the mailbox keeps only its state."""
        delta = TokenDelta(
            self.token_ids,
            self.finish_reason,
            self.logprobs,
            self.prompt_logprobs,
            self.text,
            self.stop_reason,
            self.embedding,
            self.num_cached_tokens,
        )
        self.num_cached_tokens = None
        self.token_ids = []
        self.logprobs = self.prompt_logprobs = None
        if self.text is not None:
            self.text = ""
        return delta


def deliver(
    mailboxes: dict[str, Mailbox],
    outputs: list[RequestOutput],
    pause_after: int,
    observer: RequestObserver | None,
) -> list[str]:
    """Hand each output to its request's mailbox and wake its consumer; a finished
    request leaves ``mailboxes``. Returns the ids of requests to pause: their mailbox
    came to hold ``pause_after`` unread tokens (they are marked paused)."""
    to_pause: list[str] = []
    now = time.monotonic()
    for output in outputs:
        box = mailboxes.get(output.request_id)
        if box is None:
            continue  # aborted by us already
        box.add(output)
        if output.new_token_ids:
            count_tokens(box.record, len(output.new_token_ids), now, observer)
        if output.finish_reason is not None:
            del mailboxes[output.request_id]
            record_finished(box.record, output.finish_reason, observer)
        elif not box.paused and len(box.token_ids) >= pause_after:
            box.paused = True
            to_pause.append(output.request_id)
        box.wakeup.set()
    return to_pause


class StreamOwner(Protocol):
    """What a `RequestStream` needs of the engine client that opened it."""

    #: Tokens each stream gathers before it yields a delta, after its first one.
    stream_interval: int

    async def _abort(self, ends: list[tuple[str, str]]) -> None:
        """End requests, each ``(request_id, reason)`` counted as finished with its
        reason, and abort the ones still open in the engine."""
        ...

    async def _resume(self, request_id: str) -> None:
        """Resume the paused request in the engine (its consumer reads again)."""
        ...


class RequestStream:
    """Async iterator over one request's `TokenDelta`s; ends after the finishing delta.

    Raises:
        EngineError: the engine died, the server is shutting down, or the engine rejected
            the request — raised from ``__anext__`` as soon as it is known.
    """

    def __init__(self, request_id: str, mailbox: Mailbox, client: StreamOwner) -> None:
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
        await self._client._abort([(self.request_id, reason)])

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
        delta = box.take_delta()
        if delta.finish_reason is not None:
            self.finished = True
            self.finish_reason = delta.finish_reason
        elif box.paused:
            box.paused = False
            # Shielded: a consumer that goes on reading after a cancelled wait must not
            # find its request paused for ever.
            with trio.CancelScope(shield=True):
                await self._client._resume(self.request_id)
        return delta


async def run_all(jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run every job concurrently until all end; the first `EngineError` of any job
    cancels the others and is raised (once the others have ended).

    Raises:
        EngineError: the first one a job raised.
    """
    errors: list[EngineError] = []
    async with trio.open_nursery() as nursery:

        async def run(job: Callable[[], Awaitable[None]]) -> None:
            try:
                await job()
            except EngineError as exc:
                errors.append(exc)
                nursery.cancel_scope.cancel()

        for job in jobs:
            nursery.start_soon(run, job)
    if errors:
        raise errors[0]
