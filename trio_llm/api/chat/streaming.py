"""Streamed responses: the server-sent events of one response, in its format.

What the events are is the format's (`trio_llm.api.chat.plan.ResponseFormat.stream_start`,
``stream_piece``, ``stream_end``, ``stream_error``); this module sends them in order,
one response's choices concurrently, and always ends the stream, also after an error.

The OpenAI protocol, as OpenAI and vLLM send it: every chunk of one response has the
same ``id``, ``created`` and ``model``; a chat choice's first chunk has ``delta.role``
("assistant") together with its first generated content, and later ones do not;
``finish_reason`` is null on intermediate chunks and set on each choice's last one; with
``stream_options.include_usage`` one more chunk with empty ``choices`` and the ``usage``
totals comes last; ``data: [DONE]`` always ends the stream, also after an error, which is
sent as a ``data: {"error": {...}}`` event. The Anthropic Messages and Responses streams
name their events instead and have no ``[DONE]`` (`trio_llm.api.anthropic.request`,
`trio_llm.api.responses.request`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from trio_llm.api.chat.plan import Event, Plan
from trio_llm.api.chat.run_choices import run_choices
from trio_llm.api.http.disconnect import Emit
from trio_llm.api.http.errors import APIError, engine_error, internal_error
from trio_llm.errors import EngineError
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.handle import EngineHandle
from trio_llm.text.choice import Choice, ChoiceDelta

#: Given a whole response before it is sent (`Stream.finish`, `ModelServing.run_plan`).
Finish = Callable[[dict[str, Any]], Awaitable[None]]

#: Seconds of silence after which a stream sends its format's keep-alive event.
KEEPALIVE_SECONDS = 15.0


@dataclass(eq=False)
class Stream:
    """One streamed response over all of a request's choices, in ``plan.format``.

    Attributes:
        engine: the engine the choices run in.
        plan: the response's `Plan`.
        choices: one `Choice` per engine request of the plan.
        admission: places reserved in the waiting line; released when the stream ends.
        finish: given the whole response before the event that ends the stream with it
            goes out (`ResponseFormat.final_body`: a stored response is written first);
            an `APIError` it raises is sent in that event's place, as the stream's error
            event.
    """

    engine: EngineHandle
    plan: Plan
    choices: list[Choice]
    admission: Admission
    finish: Finish | None = None
    _lock: trio.Lock = field(default_factory=trio.Lock, init=False)
    _emit: Emit | None = field(default=None, init=False)
    _started: bool = field(default=False, init=False)
    _last_sent: float = field(default=0.0, init=False)

    async def _start(self) -> None:
        """Send the format's opening events, once."""
        if not self._started:
            self._started = True
            await self._send(self.plan.format.stream_start(self.plan, self.choices))

    async def _send(self, events: list[Event]) -> None:
        emit = self._emit
        if emit is None:
            raise RuntimeError("a stream sends only while it runs")
        async with self._lock:  # choices stream concurrently; events must not interleave
            for name, data in events:
                if self.finish is not None:
                    name, data = await self._finished((name, data))
                text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
                await emit(text, name)
                self._last_sent = trio.current_time()

    async def _finished(self, event: Event) -> Event:
        """``event``, after `finish` had the whole response it carries (if it ends the
        stream with one); the error event in its place when `finish` refused."""
        body = self.plan.format.final_body(event)
        if body is None or self.finish is None:
            return event
        try:
            await self.finish(body)
        except APIError as exc:
            return self.plan.format.stream_error(exc)
        return event

    async def _keep_alive(self, event: Event) -> None:
        """Send ``event`` whenever the stream has been silent for `KEEPALIVE_SECONDS`
        since its opening events (until cancelled)."""
        while True:
            if self._started:
                silent = trio.current_time() - self._last_sent
                if silent >= KEEPALIVE_SECONDS:
                    try:
                        await self._send([event])
                    except Exception:  # the client is gone: the main task finds out
                        return
                    continue
                await trio.sleep(KEEPALIVE_SECONDS - silent)
            else:
                await trio.sleep(KEEPALIVE_SECONDS)

    async def _generate(self) -> None:
        """Run every choice; with a keep-alive event, send it while the stream is silent.

        Raises:
            as `run_choices` (never an exception group).
        """
        plan = self.plan
        on_output = self._start if plan.format.start_after_first_output else None
        run = partial(run_choices, self.engine, plan, self.choices, self.admission)
        event = plan.format.keepalive_event
        if event is None:
            await run(self._on_delta, on_output)
            return
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_alive, event)
            try:
                await run(self._on_delta, on_output)
            except Exception as exc:  # raised after the nursery: not in a group
                error = exc
            finally:
                nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _on_delta(self, choice: Choice, piece: ChoiceDelta) -> None:
        await self._start()
        await self._send(self.plan.format.stream_piece(self.plan, choice, piece))

    async def run(self, emit: Emit, *, include_usage: bool) -> None:
        """Emit every event, then the format's end marker (``[DONE]``); an engine error
        becomes an error event."""
        self._emit = emit
        plan = self.plan
        form = plan.format
        try:
            if not form.start_after_first_output:
                await self._start()
            await self._generate()
            await self._start()
            await self._send(form.stream_end(plan, self.choices, include_usage=include_usage))
        except EngineError as exc:
            await self._start()
            await self._send([form.stream_error(engine_error(exc, plan.structured_param))])
        except Exception as exc:  # a bug (a parser, the format): this stream ends, says so
            error = internal_error(exc, "streaming the response")
            await self._start()
            await self._send([form.stream_error(error)])
        finally:
            self.engine.release(self.admission)
        if form.done_marker is not None:
            await self._send([(None, form.done_marker)])
