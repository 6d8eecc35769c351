"""What the routes of stored objects (``/v1/files``, ``/v1/batches``) share: the refusal
when the server keeps no store, and OpenAI's list query (``limit``, ``order``,
``after``)."""

from __future__ import annotations

from fastapi import Request

from trio_llm.api.errors import APIError, bad_request
from trio_llm.store import Store


def require_store(store: Store | None, endpoint: str) -> Store:
    """``store``, or the 400 of a server started with ``--store-url none``."""
    if store is None:
        raise APIError(
            400,
            f"{endpoint} needs the server's store, which is off (--store-url none)",
            code="store_disabled",
        )
    return store


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"{name} must be an integer, not {text!r}", name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, not {value}", name)
    return value


def list_query(
    request: Request, *, default_limit: int, max_limit: int, orders: bool = True
) -> tuple[int, str, str | None]:
    """``(limit, order, after)`` of a list request (``order`` ``desc`` unless asked).

    Args:
        orders: whether the list takes ``order`` (a 400 for it otherwise).

    Raises:
        APIError: 400 naming a malformed parameter.
    """
    limit = _query_int(request, "limit", default_limit, 1, max_limit)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc") or (not orders and "order" in request.query_params):
        allowed = "'asc' or 'desc'" if orders else "not supported here"
        raise bad_request(f"order: {allowed}, not {order!r}", "order")
    return limit, order, request.query_params.get("after")
