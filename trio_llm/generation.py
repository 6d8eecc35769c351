"""`Generation`: one request of the embedded engine, and its `GenerationOutput`s.

Created by `trio_llm.async_engine.AsyncEngine.generate`. Entering its ``async with``
block submits the request; leaving the block before the last output aborts it in the
engine at once (its KV blocks are freed). A plain ``async for`` submits it on the first
``__anext__`` and aborts it when that call is cancelled or fails; breaking out of such a
loop cannot be noticed (this project never relies on finalizers), so code that may leave
early uses ``async with``.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.request_stream import RequestStream
from trio_llm.messages import DEFAULT_SCHEDULING, Scheduling, TokenLogprobs
from trio_llm.text.choice import Choice
from trio_llm.text.token_delta import TokenDelta


@dataclass(frozen=True)
class GenerationOutput:
    """New output of one `Generation` since the previous one.

    Attributes:
        text: text released since the previous output (may be ``""``: text that could
            still turn into a stop string or an incomplete character is held back).
        token_ids: output token ids that arrived since the previous output, oldest first.
            Their text may lag behind: ``text`` holds only what is certain.
        finish_reason: None until the last output; then "stop" (EOS, a stop token or a
            stop string), "length" (``max_tokens`` or the context is full) or "abort"
            (the engine ended the request).
        stop_reason: on the last output: the matched stop string, or the stop token id
            from ``stop_token_ids``; None for EOS and otherwise.
        logprobs: when ``SamplingParams.logprobs`` is set, one entry per token behind
            ``text`` (a stop token left out of the text has none); otherwise None.
        num_output_tokens: output tokens of the request so far, this output's included.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs] | None
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        """True for the request's last output."""
        return self.finish_reason is not None


class _State(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class Generation:
    """One request to the engine: an async context manager and an async iterator of
    `GenerationOutput`s (created by `AsyncEngine.generate`, which validated it).

    ``async with generation:`` submits the request; leaving the block before the last
    output aborts it in the engine (KV blocks freed at once). A plain ``async for``
    submits it on the first ``__anext__`` and aborts it when ``__anext__`` is cancelled or
    fails; leaving such a loop with ``break`` leaves the request running in the engine
    until it finishes (or the engine is closed). A generation is used once.

    Attributes:
        request_id: the caller's label (``request_id`` of `AsyncEngine.generate`), or
            ``"gen-N"``; the engine's own request id is internal.
        prompt_token_ids: the prompt as the engine sees it.
        params: the sampling parameters.
        scheduling: its priority (`AsyncEngine.generate`'s ``priority``) and lane.
        entered: True once used as an ``async with`` block (the form that aborts on any
            early exit); False for a plain ``async for``.
        num_output_tokens: output tokens delivered so far.
        finish_reason: None until the last output was delivered.
        stop_reason: the last output's ``stop_reason``.

    Raises (from ``__aenter__`` or the first ``__anext__``):
        EngineDeadError: the engine has died.
        EngineShutdownError: the engine is stopping (its ``open_engine`` block is ending).
    Raises (from ``__anext__``):
        EngineDeadError: the engine died while generating.
        RequestRejectedError: the engine refused the request.
        RuntimeError: the generation was closed before its last output and is iterated
            again.
    """

    def __init__(
        self,
        client: EngineClient,
        choice: Choice,
        prompt_token_ids: list[int],
        request_id: str,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = choice.params
        self.scheduling = scheduling
        self.entered = False
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._client = client
        self._state = _State.NEW
        self._request: AbstractAsyncContextManager[RequestStream] | None = None
        self._stream: RequestStream | None = None
        #: Turns the engine's deltas into text (stop strings, logprobs aligned with it).
        self._choice = choice
        self._held_token_ids: list[int] = []

    def __repr__(self) -> str:
        return (
            f"<Generation {self.request_id} {self._state.value}, "
            f"{self.num_output_tokens} output tokens, finish_reason={self.finish_reason!r}>"
        )

    @property
    def finished(self) -> bool:
        """True once the last output was delivered."""
        return self.finish_reason is not None

    # ------------------------------------------------------------ lifetime

    async def __aenter__(self) -> Generation:
        if self._state is not _State.NEW:
            raise RuntimeError("a Generation can be entered once, before it is iterated")
        self.entered = True
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._close()

    async def _open(self) -> None:
        self._state = _State.OPEN
        request = self._client.open_request(self.prompt_token_ids, self.params, self.scheduling)
        try:
            self._stream = await request.__aenter__()
        except BaseException:
            self._state = _State.CLOSED
            raise
        self._request = request

    async def _close(self) -> None:
        """Abort the request in the engine unless it finished (the abort is shielded)."""
        self._state = _State.CLOSED
        request, self._request = self._request, None
        if request is not None:
            # open_request aborts an unfinished request in a shielded scope.
            await request.__aexit__(None, None, None)

    # ------------------------------------------------------------ iteration

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._state is _State.NEW:
            await self._open()
        elif self._state is _State.CLOSED:
            if self.finished or not self.entered:
                raise StopAsyncIteration
            raise RuntimeError(
                "this generation was closed before its last output (its async with block "
                "was left); iterate it inside the block"
            )
        if self.finished:
            if not self.entered:
                await self._close()
            raise StopAsyncIteration
        try:
            output = await self._next_output()
        except BaseException:
            if not self.entered:
                await self._close()
            raise
        if output.finished and not self.entered:
            await self._close()
        return output

    async def _next_output(self) -> GenerationOutput:
        stream = self._stream
        if stream is None:
            raise RuntimeError("the generation's output stream is not open")
        while True:
            try:
                delta = await stream.__anext__()
            except StopAsyncIteration:
                raise RuntimeError("the engine ended the request without a finish_reason") from None
            output = self._take(delta)
            if output is None:
                continue
            if output.finished and not stream.finished:
                # A stop string matched here (inline mode): end the request in the engine.
                await stream.finish(output.finish_reason or "stop")
            return output

    def _take(self, delta: TokenDelta) -> GenerationOutput | None:
        """The output for one engine delta, or None while all of its text is held back."""
        choice = self._choice
        before = choice.num_output_tokens
        # Several tokens at once are taken one by one (`RequestDetokenizer.process`), so
        # a stop string ends the output at the token that completes it; later ones are
        # not counted.
        piece = choice.process(delta)
        self._held_token_ids += delta.token_ids[: choice.num_output_tokens - before]
        if piece is None:
            return None
        token_ids, self._held_token_ids = self._held_token_ids, []
        self.num_output_tokens += len(token_ids)
        self.finish_reason, self.stop_reason = choice.finish_reason, choice.stop_reason
        return GenerationOutput(
            text=piece.text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=piece.logprobs if self.params.logprobs is not None else None,
            num_output_tokens=self.num_output_tokens,
        )
