"""What every route of stored objects shares (``/v1/responses/{id}``, ``/v1/conversations``,
``/v1/files``, ``/v1/batches``): the answer of a server that keeps no store
(`need_store`), and OpenAI's list query, ``limit``, ``order`` and ``after`` (`ListParams`),
with the page it asks for in OpenAI's list body (`trio_llm.store.objects.Page`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from trio_llm.api.http.errors import APIError, bad_request
from trio_llm.store import NotFound, Store, Transaction
from trio_llm.store.objects import Page


def need_store(store: Store | None, kind: str) -> Store:
    """The server's store, for a route of ``kind`` (``responses``, ``files``, ...).

    Raises:
        APIError: 404 (code ``store_disabled``) with ``--store-url none``: nothing is
            stored here.
    """
    if store is None:
        raise APIError(
            404,
            f"this server keeps no {kind} (--store-url none)",
            type="not_found_error",
            code="store_disabled",
        )
    return store


@dataclass(frozen=True)
class ListParams:
    """A list route's query.

    Attributes:
        after: the id of the item the page follows, or None: from the first.
        limit: most items on the page.
        order: ``asc`` (oldest first) or ``desc``.
    """

    after: str | None = None
    limit: int = 20
    order: str = "desc"

    @classmethod
    def of(
        cls,
        request: Request,
        *,
        default_limit: int = 20,
        max_limit: int = 100,
        orders: bool = True,
    ) -> ListParams:
        """The query of ``request`` (OpenAI's defaults: 20 items, newest first; the
        Files API's are 10,000 of at most 10,000).

        Args:
            orders: whether the list takes ``order`` (the Batch API's does not: a 400).

        Raises:
            APIError: 400 naming ``limit`` or ``order`` for a value out of range.
        """
        query = request.query_params
        limit_text = query.get("limit", str(default_limit))
        try:
            limit = int(limit_text)
        except ValueError:
            limit = 0
        if not 1 <= limit <= max_limit:
            raise bad_request(
                f"limit must be an integer from 1 to {max_limit}, got {limit_text!r}", "limit"
            )
        order = query.get("order", cls.order)
        if order not in ("asc", "desc") or (not orders and "order" in query):
            allowed = "'asc' or 'desc'" if orders else "not supported on this list"
            raise bad_request(f"order must be {allowed}, got {order!r}", "order")
        return cls(query.get("after") or None, limit, order)

    async def page(self, store: Store, work: Callable[..., Page]) -> JSONResponse:
        """The list body of the page ``work(tx, after=, limit=, order=)`` reads.

        Raises:
            APIError: 400 naming ``after`` for an id the list does not hold.
            StoreError: the store's own (an unknown list is `NotFound`: a 404).
        """
        query = {"after": self.after, "limit": self.limit, "order": self.order}
        try:
            found = await store.transaction(lambda tx: work(tx, **query))
        except NotFound as exc:
            if exc.kind in ("item", "batch", "file") and exc.object_id == self.after:
                raise bad_request(f"after: {exc}", "after") from exc
            raise
        return JSONResponse(found.body())


async def stored_json(
    store: Store | None, kind: str, work: Callable[[Transaction], Any]
) -> JSONResponse:
    """``work``'s answer, in a transaction of the server's store, as a JSON response.

    Raises:
        APIError: as `need_store`.
        StoreError: as ``work`` (`NotFound`: a 404).
    """
    return JSONResponse(await need_store(store, kind).transaction(work))
