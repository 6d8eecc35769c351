"""The query of OpenAI's list routes (``limit``, ``order``, ``after``), checked, and the
page they ask for in OpenAI's list body (`trio_llm.store.objects.Page`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from trio_llm.api.errors import bad_request
from trio_llm.store import NotFound, Store, Transaction
from trio_llm.store.objects import Page

#: Most items a page holds (OpenAI's ``limit`` range is 1 to 100).
MAX_LIMIT = 100


@dataclass(frozen=True)
class ListParams:
    """A list route's query.

    Attributes:
        after: the id of the item the page follows, or None: from the first.
        limit: most items on the page (1 to `MAX_LIMIT`).
        order: ``asc`` (oldest first) or ``desc``.
    """

    after: str | None = None
    limit: int = 20
    order: str = "desc"

    @classmethod
    def of(cls, request: Request) -> ListParams:
        """The query of ``request`` (OpenAI's defaults: 20 items, newest first).

        Raises:
            APIError: 400 naming ``limit`` or ``order`` for a value out of range.
        """
        query = request.query_params
        limit_text = query.get("limit", str(cls.limit))
        try:
            limit = int(limit_text)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIMIT:
            raise bad_request(
                f"limit must be an integer from 1 to {MAX_LIMIT}, got {limit_text!r}", "limit"
            )
        order = query.get("order", cls.order)
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
        return cls(query.get("after") or None, limit, order)

    async def page(
        self, store: Store, work: Callable[[Transaction, str | None, int, str], Page]
    ) -> dict[str, Any]:
        """The list body of the page ``work(tx, after, limit, order)`` reads.

        Raises:
            APIError: 400 naming ``after`` for an id the list does not hold.
            StoreError: the store's own (an unknown list is `NotFound`: a 404).
        """
        try:
            found = await store.transaction(lambda tx: work(tx, self.after, self.limit, self.order))
        except NotFound as exc:
            if exc.kind == "item" and exc.object_id == self.after:
                raise bad_request(f"after: {exc}", "after") from exc
            raise
        return found.body()
