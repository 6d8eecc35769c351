"""A response: its `Plan` (what it will run) and the `ResponseFormat` it is written in.

A `Plan` lists one engine request per choice (each prompt of a batch, ``n`` times, with
choice index ``prompt_index * n + sample``, as vLLM numbers them) and the format its
output is written in; `trio_llm.api.chat.planner` builds it,
`trio_llm.api.chat.run_choices.run_choices` runs it. `ResponseFormat` is the base of the
output formats (`trio_llm.api.chat.format`): it renders the whole response body, the
events of a stream (server-sent events), the ``usage``, and the logprobs of a WebSocket
``delta`` event.

A format instance belongs to one response (its `Plan`): it keeps per-choice state, such
as the text offsets of completion logprobs and whether a choice's first chunk (which
carries an echoed prompt, or the chat role) went out.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from trio_llm.api.http.errors import APIError
from trio_llm.messages import DEFAULT_SCHEDULING, SamplingParams, Scheduling
from trio_llm.text.choice import Choice, ChoiceDelta
from trio_llm.text.tokenizer import Tokenizer

#: One server-sent event: its name (None: unnamed) and its data (JSON, or text as is).
Event = tuple[str | None, Any]


@dataclass
class Plan:
    """Everything needed to answer one request, decided before anything is sent.

    Attributes:
        format: renders the choices (chat or completion; one instance per response).
        model: the served model name the response reports.
        echo: completions ``echo``: each choice begins with its prompt.
        requests: ``(prompt_token_ids, params)`` per choice, in choice-index order.
        prompt_lengths: token count of each distinct prompt (for usage).
        echo_texts: per choice, the prompt text to prepend (completions ``echo``).
        num_top_logprobs: alternatives per token when logprobs were asked for, else None.
        num_prompt_logprobs: alternatives per prompt token for vLLM's ``prompt_logprobs``
            (completions), else None.
        structured_param: the request field of its output constraint (what an engine
            error about the constraint names), else None.
        scheduling: the priority and lane of every engine request
            (`RequestBody.scheduling`).
        output_bounds: per choice, the limit that set its ``max_tokens``
            (`trio_llm.frontend.preprocess.OUTPUT_BOUNDS`): what cut an output that
            reached it.
        response_id, created: the response's ``id`` and ``created`` (Unix seconds),
            set when the request is admitted (`ModelServing.admit`).
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
    scheduling: Scheduling = DEFAULT_SCHEDULING
    output_bounds: list[str] = field(default_factory=list)

    def add_prompt(
        self,
        token_ids: list[int],
        params: list[SamplingParams],
        echo_text: str | None,
        output_bound: str = "request",
    ) -> None:
        """Add one prompt with one `SamplingParams` per sample, whose ``max_tokens`` was
        set by ``output_bound``."""
        self.prompt_lengths.append(len(token_ids))
        for sample in params:
            self.requests.append((token_ids, sample))
            self.echo_texts.append(echo_text)
            self.output_bounds.append(output_bound)

    def output_bound(self, index: int) -> str:
        """What set choice ``index``'s ``max_tokens`` (``"request"`` where unknown)."""
        return self.output_bounds[index] if index < len(self.output_bounds) else "request"


def num_cached_tokens(plan: Plan, choices: list[Choice]) -> int:
    """Prompt tokens that came from the prefix cache, each prompt counted once (by its
    first choice, as its tokens are counted once in ``prompt_tokens``)."""
    if not plan.prompt_lengths:
        return 0
    n = max(1, len(plan.requests) // len(plan.prompt_lengths))
    return sum(choice.num_cached_tokens for choice in choices if choice.index % n == 0)


def usage(plan: Plan, choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's ``usage``: each prompt counted once, every choice's output tokens, and
    ``prompt_tokens_details.cached_tokens`` (prompt tokens from the prefix cache; OpenAI
    always sends it, vLLM with ``--enable-prompt-tokens-details``)."""
    prompt = sum(plan.prompt_lengths)
    completion = sum(choice.num_output_tokens for choice in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens(plan, choices)},
    }


class ResponseFormat(ABC):
    """Renders the choices of one response (base class; see the module doc).

    Attributes:
        id_prefix: the response ``id``'s prefix (``cmpl``, ``chatcmpl``).
        object: the ``object`` of a whole response.
        chunk_object: the ``object`` of a stream chunk.
    """

    id_prefix = ""
    object = ""
    chunk_object = ""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_id(self) -> str:
        """A fresh response ``id``: ``<id_prefix>-<32 hex digits>``."""
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        """The whole (non-streamed) response body."""
        return {
            "id": plan.response_id,
            "object": self.object,
            "created": plan.created,
            "model": plan.model,
            "choices": [self.final_choice(plan, choice) for choice in choices],
            "usage": usage(plan, choices),
        }

    def chunk(
        self, plan: Plan, entries: list[dict[str, Any]], choices: list[Choice] | None = None
    ) -> dict[str, Any]:
        """One stream chunk carrying the choice ``entries``; with ``choices`` (the
        stream's last chunk, when usage was asked for) the ``usage`` of those."""
        body: dict[str, Any] = {
            "id": plan.response_id,
            "object": self.chunk_object,
            "created": plan.created,
            "model": plan.model,
            "choices": entries,
        }
        if choices is not None:
            body["usage"] = usage(plan, choices)
        return body

    @abstractmethod
    def final_choice(self, plan: Plan, choice: Choice) -> dict[str, Any]:
        """One entry of a whole response's ``choices`` (the choice has finished)."""

    # ------------------------------------------------ streamed (server-sent events)

    #: The data of the stream's last event (None: the stream just ends).
    done_marker: str | None = "[DONE]"

    #: True: `stream_start`'s events wait for the engine's first output (they report
    #: what only it knows, such as the prefix-cache hits); False: they go out at once.
    start_after_first_output = False

    #: An event sent when the stream has been silent for `KEEPALIVE_SECONDS` after its
    #: opening events (a long prefill, a long wait in the queue), or None for none.
    keepalive_event: Event | None = None

    def stream_start(self, plan: Plan, choices: list[Choice]) -> list[Event]:
        """The events a stream opens with, before any output (none here)."""
        return []

    def stream_piece(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> list[Event]:
        """The events that carry ``piece`` of ``choice`` (one chunk here, or none)."""
        entry = self.chunk_choice(plan, choice, piece)
        return [] if entry is None else [(None, self.chunk(plan, [entry]))]

    def stream_end(self, plan: Plan, choices: list[Choice], *, include_usage: bool) -> list[Event]:
        """The events after every choice finished (here the usage chunk, if asked for)."""
        return [(None, self.chunk(plan, [], choices))] if include_usage else []

    def stream_error(self, error: APIError) -> Event:
        """The event that reports ``error`` in the middle of a stream."""
        return (None, error.body())

    def final_body(self, event: Event) -> dict[str, Any] | None:
        """The whole response an event carries when it ends the stream with it (the
        Responses API's ``response.completed``), else None (here: none does)."""
        return None

    @abstractmethod
    def chunk_choice(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> dict[str, Any] | None:
        """The ``choices`` entry of the stream chunk that carries ``piece``, or None when
        there is nothing to send yet."""

    @abstractmethod
    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        """The ``logprobs`` of the WebSocket ``delta`` event that carries ``piece``
        (only called when the request asked for logprobs)."""


def choice_entry(
    index: int,
    key: str,
    value: Any,
    logprobs: Any,
    finish_reason: str | None,
    source: Choice | ChoiceDelta | None,
) -> dict[str, Any]:
    """A ``choices`` entry, its fields in the order OpenAI and vLLM send them."""
    return {
        "index": index,
        key: value,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": source.stop_reason if source is not None else None,
    }
