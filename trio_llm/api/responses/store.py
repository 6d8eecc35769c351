"""Writing responses to the store from the API: the stored form of a response
(`stored_form`), the unit of work that records one that ended (`record`), and writes
whose failure is logged and becomes the client's error (`write`, `update`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from trio_llm.api.chat.request_body import known_fields
from trio_llm.api.http.errors import store_error
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.store import Store, StoreError, Transaction, conversations, responses
from trio_llm.store.conversations import ConversationFull, ConversationLimits
from trio_llm.store.responses import StoredResponse, stored_response

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Statuses of a response whose items join its conversation.
ENDED_WELL = ("completed", "incomplete")


def stored_form(request: ResponsesRequest, body: dict[str, Any]) -> StoredResponse:
    """The stored form of the response ``body`` to ``request``: the request's known
    fields as sent (`known_fields`: what running it again takes; unknown fields are not
    kept), and its context then its input items as the items it was generated from."""
    sent = known_fields(request)
    return stored_response(body["id"], body, sent, request.context, request.items)


def record(
    request: ResponsesRequest,
    stored: StoredResponse,
    tx: Transaction,
    *,
    new: bool,
    limits: ConversationLimits | None,
) -> None:
    """Write a response that ended (``new``: a foreground one, not stored yet; stored
    only if the request is) and add its input and output items to its conversation;
    nothing if a background response was cancelled or deleted meanwhile.

    Raises:
        NotFound: the conversation is gone (deleted meanwhile): nothing is written.
        ConversationFull: the items would pass the conversation's ``limits``: nothing
            is written.
    """
    if new and request.stored:
        responses.insert(tx, stored)
    elif not new and not responses.update(tx, stored):
        return
    conversation_id = request.conversation_id
    if conversation_id is not None and stored.status in ENDED_WELL:
        added = [*request.items, *stored.body["output"]]
        try:
            conversations.add_items(tx, conversation_id, added, limits)
        except ConversationFull as exc:
            exc.param = "conversation"
            raise


async def write(store: Store, work: Callable[[Transaction], T], response_id: str) -> T:
    """Run ``work`` in a transaction.

    Raises:
        APIError: the store failed (`store_error`); logged, naming the response.
    """
    try:
        return await store.transaction(work)
    except StoreError as exc:
        logger.error(f"store: response {response_id} not written: {exc}")
        raise store_error(exc) from exc


async def update(
    store: Store,
    stored: StoredResponse,
    body: dict[str, Any],
    taking_over_from: str | object | None = responses.SAME,
) -> bool:
    """Write ``body`` over a stored response still active and run by ``stored.runner``
    (or by ``taking_over_from``: `responses.update`); False if it no longer is.

    Raises:
        APIError: as `write`.
    """
    work = partial(
        responses.update, response=stored.with_body(body), taking_over_from=taking_over_from
    )
    return await write(store, work, stored.id)
