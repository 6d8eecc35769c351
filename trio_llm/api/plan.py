"""What one API request will run: its `Plan`, and `run_choices`, which runs it.

A `Plan` lists one engine request per choice (each prompt of a batch, ``n`` times, with
choice index ``prompt_index * n + sample``, as vLLM numbers them) and the `ResponseFormat`
its output is written in. `run_choices` submits them all at once and drives each choice
in its own task; leaving early for any reason (a client that left, an error, a
cancellation) aborts every unfinished one in the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from trio_llm.api.formats import ResponseFormat
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.preprocess import run_all
from trio_llm.frontend.request_stream import RequestStream
from trio_llm.messages import SamplingParams
from trio_llm.text.choice import Choice, ChoiceDelta


@dataclass
class Plan:
    """Everything needed to answer one request, decided before anything is sent.

    Attributes:
        format: renders the choices (chat or completion; one instance per response).
        requests: ``(prompt_token_ids, params)`` per choice, in choice-index order.
        prompt_lengths: token count of each distinct prompt (for usage).
        echo_texts: per choice, the prompt text to prepend (completions ``echo``).
        num_top_logprobs: alternatives per token when logprobs were asked for, else None.
        num_prompt_logprobs: alternatives per prompt token for vLLM's ``prompt_logprobs``
            (completions), else None.
        structured_param: the request field of its output constraint (what an engine
            error about the constraint names), else None.
    """

    format: ResponseFormat
    model: str
    echo: bool = False
    num_top_logprobs: int | None = None
    num_prompt_logprobs: int | None = None
    requests: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    echo_texts: list[str | None] = field(default_factory=list)
    response_id: str = ""
    created: int = 0
    structured_param: str | None = None

    def add_prompt(
        self, token_ids: list[int], params: list[SamplingParams], echo_text: str | None
    ) -> None:
        """Add one prompt with one `SamplingParams` per sample."""
        self.prompt_lengths.append(len(token_ids))
        for sample in params:
            self.requests.append((token_ids, sample))
            self.echo_texts.append(echo_text)


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

    async with engine.open_requests(plan.requests, admission) as streams:
        await run_all([partial(drive, c, s) for c, s in zip(choices, streams, strict=True)])
