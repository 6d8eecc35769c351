"""OpenAI's Conversations API: ``POST /v1/conversations`` (``items``, ``metadata``),
``GET``/``POST`` (new metadata)/``DELETE /v1/conversations/{id}``, its items listed
(``GET .../items``: ``limit``, ``order``, ``after``) and added (``POST .../items``), one
item read or deleted (``GET``/``DELETE .../items/{item_id}``). A conversation is bounded
(``--max-conversation-items``, ``--max-conversation-size``): an append past a limit is a
400 naming it (``conversation_too_large``), the conversation unchanged.

Items are checked as a response's input items are (`trio_llm.api.responses.request.check_items`:
a conversation is a later response's context) and stored with an ``id`` each
(`trio_llm.api.responses.items`); a response created with ``conversation`` reads them and
appends its own (`trio_llm.api.responses.handlers`). The units of work are
`trio_llm.store.conversations`'.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, Field
from starlette.types import Receive

from trio_llm.api.chat.request_body import RequestBody, Text
from trio_llm.api.http.store_routes import ListParams, need_store
from trio_llm.api.model_router import ModelRouter
from trio_llm.api.responses.items import stored_items
from trio_llm.api.responses.request import check_items
from trio_llm.store import Store, conversations
from trio_llm.store.objects import Page

#: Most items one request adds (OpenAI's limit).
MAX_ITEMS = 20
#: OpenAI's metadata limits: pairs, key length, value length.
MAX_METADATA = (16, 64, 512)


def _check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    pairs, key_length, value_length = MAX_METADATA
    if len(metadata) > pairs:
        raise ValueError(f"metadata holds at most {pairs} key-value pairs")
    for key, value in metadata.items():
        if len(key) > key_length or len(value) > value_length:
            raise ValueError(
                f"metadata keys are at most {key_length} characters and values at most "
                f"{value_length} (key {key[:80]!r})"
            )
    return metadata


#: OpenAI's ``metadata``: up to 16 string pairs.
Metadata = Annotated[dict[Text, Text], AfterValidator(_check_metadata)]
Items = Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]


class ConversationCreateRequest(RequestBody):
    """``POST /v1/conversations``."""

    items: Items | None = None
    metadata: Metadata | None = None


class ConversationUpdateRequest(RequestBody):
    """``POST /v1/conversations/{conversation_id}``: the new metadata."""

    metadata: Metadata


class ConversationItemsRequest(RequestBody):
    """``POST /v1/conversations/{conversation_id}/items``."""

    items: Annotated[Items, Field(min_length=1)]


class ConversationsAPI:
    """The Conversations API's routes over the server's store (see the module doc)."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def _store(self) -> Store:
        return need_store(self.router.store, "conversations")

    async def create(self, body: ConversationCreateRequest, receive: Receive) -> Response:
        """``POST /v1/conversations``: a new conversation."""
        store = self._store()
        items = _checked(body.items or [])
        work = partial(
            conversations.create,
            metadata=body.metadata or {},
            items=items,
            limits=store.conversation_limits,
        )
        return JSONResponse(await store.transaction(work))

    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/conversations/{conversation_id}``."""
        work = partial(conversations.get, conversation_id=_id(request))
        return JSONResponse(await self._store().transaction(work))

    async def update(self, request: Request) -> Response:
        """``POST /v1/conversations/{conversation_id}``: replace the metadata."""
        store = self._store()
        body = await self.router.parse(ConversationUpdateRequest, request)
        work = partial(conversations.update, conversation_id=_id(request), metadata=body.metadata)
        return JSONResponse(await store.transaction(work))

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/conversations/{conversation_id}`` (its items too)."""
        conversation_id = _id(request)
        work = partial(conversations.delete, conversation_id=conversation_id)
        await self._store().transaction(work)
        deleted = {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
        return JSONResponse(deleted)

    async def list_items(self, request: Request) -> Response:
        """``GET /v1/conversations/{conversation_id}/items``: a page of its items."""
        work = partial(conversations.list_items, conversation_id=_id(request))
        return await ListParams.of(request).page(self._store(), work)

    async def add_items(self, request: Request) -> Response:
        """``POST /v1/conversations/{conversation_id}/items``: append items; the list of
        those added."""
        store = self._store()
        body = await self.router.parse(ConversationItemsRequest, request)
        work = partial(
            conversations.add_items,
            conversation_id=_id(request),
            items=_checked(body.items),
            limits=store.conversation_limits,
        )
        added = await store.transaction(work)
        return JSONResponse(Page(added, has_more=False).body())

    async def get_item(self, request: Request) -> Response:
        """``GET /v1/conversations/{conversation_id}/items/{item_id}``."""
        item_id = request.path_params["item_id"]
        work = partial(conversations.get_item, conversation_id=_id(request), item_id=item_id)
        return JSONResponse(await self._store().transaction(work))

    async def delete_item(self, request: Request) -> Response:
        """``DELETE /v1/conversations/{conversation_id}/items/{item_id}``: the
        conversation, as OpenAI answers."""
        item_id = request.path_params["item_id"]
        work = partial(conversations.delete_item, conversation_id=_id(request), item_id=item_id)
        return JSONResponse(await self._store().transaction(work))


def _id(request: Request) -> str:
    return str(request.path_params["conversation_id"])


def _checked(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` as stored (with ids), after the checks of a response's input items.

    Raises:
        APIError: 400 naming ``items``.
    """
    check_items(items, "items")
    return stored_items(items)
