"""The messages of the WebSocket protocol (``/v1/ws``, see ``docs/websocket.md``): the
client's checked and validated as the HTTP routes check theirs, and the server's
``error`` and ``done`` events."""

from __future__ import annotations

from typing import Any

from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.plan import usage
from trio_llm.api.chat.planner import Plan
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.request_body import check_unicode
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import APIError, bad_request
from trio_llm.api.http.parsing import validate
from trio_llm.text.choice import Choice

#: Longest generation ``id`` accepted (characters).
MAX_ID_LENGTH = 256

#: Longest stretch of a client's ``type`` quoted in an error event (characters).
MAX_QUOTED_TYPE_LENGTH = 64

#: The message types that start a generation.
GENERATION_TYPES = ("completion", "chat")


def invalid_id(generation_id: Any) -> APIError | None:
    """The error for a message's invalid ``id``, or None for a valid one."""
    if not isinstance(generation_id, str) or not 0 < len(generation_id) <= MAX_ID_LENGTH:
        problem = f"`id` must be a non-empty string of at most {MAX_ID_LENGTH} characters"
        return bad_request(problem, "id")
    try:
        check_unicode(generation_id)
    except ValueError as exc:
        return bad_request(f"`id`: {exc}", "id")
    return None


def error_event(generation_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` event of ``body`` (an error body), for the generation
    ``generation_id`` (None: for no generation)."""
    return {"type": "error", "id": generation_id, **body}


def parse_request(
    kind: str, message: dict[str, Any], serving: ModelServing
) -> CompletionRequest | ChatCompletionRequest:
    """Validate a ``completion`` / ``chat`` message as the HTTP routes validate their body
    (`trio_llm.api.http.parsing.validate`: the server's limits first, then every field).

    Raises:
        APIError: a 400 naming the field at fault, as the HTTP route would answer.
    """
    ignored = ("type", "id", "stream", "stream_options")
    fields = {name: value for name, value in message.items() if name not in ignored}
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    request = validate(
        model,
        fields,
        serving.limits,
        max_model_len=serving.max_model_len,
        vocab_size=serving.vocab_size,
    )
    if isinstance(request, CompletionRequest) and request.echo:
        raise bad_request("`echo` is not supported over the WebSocket", "echo")
    return request


def done_event(generation_id: str, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
    """The ``done`` event of a generation: each choice's finish (``abort`` for one that
    did not finish) and the usage."""
    return {
        "type": "done",
        "id": generation_id,
        "choices": [
            {
                "index": choice.index,
                "finish_reason": choice.finish_reason or "abort",
                "stop_reason": choice.stop_reason,
            }
            for choice in choices
        ],
        "usage": usage(plan, choices),
    }
