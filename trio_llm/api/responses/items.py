"""Items as the Responses and Conversations APIs store and list them: each with a
``type``, an ``id`` and a ``status``, a message's content as parts.

A request's ``input`` (a string, or items some of which lack an ``id``, their content a
string) becomes `stored_items`: what ``GET /v1/responses/{id}/input_items`` lists, what a
conversation holds, and what a continuation (``previous_response_id``, ``conversation``)
puts before its new input. The chat path reads them as it reads any input items
(`trio_llm.api.responses.request`): the text is unchanged.
"""

from __future__ import annotations

from typing import Any

from trio_llm.store.objects import new_id

#: The id prefix of each item type (OpenAI's; ``item`` for a type without one).
ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}

#: Item types that carry into a continuation's prompt. Reasoning items do not: the chat
#: templates served here show no earlier turn's reasoning, so it is dropped, as the
#: template would drop it.
CONTEXT_TYPES = ("message", "function_call", "function_call_output")


def stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with its ``type`` (``message`` when absent), an ``id`` (a new one when
    absent), ``status`` ``completed`` when absent, and a message's string content as one
    text part (``output_text`` for the assistant's, else ``input_text``). Anything else is
    kept as sent (the chat path checks it)."""
    kind = item.get("type", "message")
    stored: dict[str, Any] = {"type": kind}
    if not isinstance(item.get("id"), str):
        stored["id"] = new_id(ID_PREFIXES.get(kind, "item_"))
    stored.update(item)
    stored["type"] = kind
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        stored["content"] = [{"type": part, "text": item["content"]}]
    stored.setdefault("status", "completed")
    return stored


def stored_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as stored items (a string is one user message)."""
    if isinstance(given, str):
        return [stored_item({"type": "message", "role": "user", "content": given})]
    return [stored_item(item) for item in given]


def context_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items of a stored context that reach the prompt (`CONTEXT_TYPES`)."""
    return [item for item in items if item.get("type", "message") in CONTEXT_TYPES]
