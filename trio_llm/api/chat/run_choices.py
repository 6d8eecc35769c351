"""Running a request's `Plan`: `run_choices`, and `run_connected` around it.

`run_choices` submits the plan's engine requests all at once and drives each choice in
its own task; leaving early for any reason (a client that left, an error, a
cancellation) aborts every unfinished one in the engine. Non-streamed responses, streams
(`trio_llm.api.chat.streaming`) and the WebSocket (`trio_llm.api.websocket.handler`) run
their choices through it. `run_connected` runs a non-streamed response's engine requests while its
client is connected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from starlette.types import Receive

from trio_llm.api.chat.plan import Plan
from trio_llm.api.http.disconnect import run_while_connected
from trio_llm.api.http.errors import engine_error
from trio_llm.errors import EngineError
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.request_stream import RequestStream, run_all
from trio_llm.text.choice import Choice, ChoiceDelta

#: What a caller of `run_choices` is given for each piece of a choice's output.
OnDelta = Callable[[Choice, ChoiceDelta], Awaitable[None]]


async def run_choices(
    engine: EngineHandle,
    plan: Plan,
    choices: list[Choice],
    admission: Admission,
    on_delta: OnDelta | None,
    on_output: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Generate every choice to its end, calling ``on_output`` (if given) for every
    output of the engine once the choice took it, also one that carries no text yet (the
    first, when the engine scheduled the request), then ``on_delta`` for each piece of
    output.

    Raises:
        EngineError: the first engine error of any choice (the others are then aborted).
    """

    async def drive(choice: Choice, stream: RequestStream) -> None:
        async for delta in stream:
            piece = choice.process(delta)
            if on_output is not None:
                await on_output()
            if piece is not None and on_delta is not None:
                await on_delta(choice, piece)
            if choice.finished:
                await stream.finish(choice.finish_reason or "stop")
                return

    async with engine.open_requests(plan.requests, admission, plan.scheduling) as streams:
        await run_all([partial(drive, c, s) for c, s in zip(choices, streams, strict=True)])


async def run_connected(
    engine: EngineHandle,
    receive: Receive,
    admission: Admission,
    work: Callable[[], Awaitable[None]],
    structured_param: str | None = None,
) -> bool:
    """Run ``work`` (a non-streamed response's engine requests) while the client is
    connected; False if it left first. The admission is released either way.

    Raises:
        APIError: the engine failed the requests (`engine_error`; a refusal of the output
            constraint names ``structured_param``).
    """

    async def run() -> bool:
        await work()
        return True

    try:
        return await run_while_connected(receive, run) is not None
    except EngineError as exc:
        raise engine_error(exc, structured_param) from exc
    finally:
        engine.release(admission)
