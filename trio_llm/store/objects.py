"""What every kind of stored object shares: ids, JSON columns, the two ways a lookup fails
(`NotFound`, `Evicted`: the retention policy removed it) and OpenAI's list pages.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trio_llm.store.database import Row, StoreError, Transaction

#: The kinds of stored object, as the errors name them.
Kind = Literal["response", "conversation", "conversation item", "file", "batch"]


class NotFound(StoreError):
    """No object of this kind has this id (never stored, or deleted by a client).

    Attributes:
        kind: what was looked up (``response``, ``file``, ...).
        object_id: the id asked for.
    """

    def __init__(self, kind: str, object_id: str) -> None:
        super().__init__(f"no {kind} with id '{object_id}' found")
        self.kind = kind
        self.object_id = object_id


class Evicted(NotFound):
    """The object was stored and later removed by the store's retention (its age or the
    store's size); the message says which (``--store-retention``, ``--store-max-size``)."""

    def __init__(self, kind: str, object_id: str, reason: str) -> None:
        super().__init__(kind, object_id)
        self.args = (f"the {kind} '{object_id}' is no longer stored: {reason}",)


def new_id(prefix: str) -> str:
    """A new object id: ``prefix`` and 32 hex digits (``resp_...``, ``file-...``)."""
    return f"{prefix}{uuid.uuid4().hex}"


def new_ordered_id(prefix: str) -> str:
    """A new object id whose 32 hex digits sort in creation order (the time in
    nanoseconds, then 64 random bits): a list ordered by ``(created_at, id)`` keeps the
    order objects were made in within a second."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(8)}"


def now() -> int:
    """The current time in whole seconds since the epoch (the APIs' ``created_at``)."""
    return int(time.time())


#: A UTF-16 surrogate: valid in JSON text as an escape (``"\\ud800"``), a character no
#: UTF-8 text (a database's, a file's) can hold.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def dumps(value: Any) -> str:
    """JSON text of a column or of a batch's output line: compact, Unicode kept, and
    always encodable as UTF-8: a lone surrogate a client sent (valid JSON) stays the
    escape it came as, so `loads` gives the same value back."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return _SURROGATE.sub(_escape, text)


def loads(text: str) -> Any:
    """The value of a JSON column."""
    return json.loads(text)


def row_of(tx: Transaction, kind: Kind, sql: str, object_id: str) -> Row:
    """The row ``sql`` (a query with one ``?``, the id) finds for ``object_id``.

    Raises:
        NotFound: none (`Evicted` where the retention removed it: `missing`).
    """
    row = tx.one(sql, (object_id,))
    if row is None:
        raise missing(tx, kind, object_id)
    return row


def missing(tx: Transaction, kind: Kind, object_id: str) -> NotFound:
    """The error for an id that is not stored: `Evicted` where the retention removed it."""
    row = tx.one("SELECT reason FROM evicted WHERE id = ?", (object_id,))
    if row is not None:
        return Evicted(kind, object_id, row[0])
    return NotFound(kind, object_id)


@dataclass(frozen=True)
class Page:
    """One page of a list (OpenAI's cursor pagination).

    Attributes:
        data: the objects, in the order asked for.
        has_more: more objects follow the last one.
    """

    data: list[dict[str, Any]]
    has_more: bool

    def body(self) -> dict[str, Any]:
        """The ``{"object": "list", "data", "first_id", "last_id", "has_more"}`` body."""
        ids = [item.get("id") for item in self.data]
        return {
            "object": "list",
            "data": self.data,
            "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None,
            "has_more": self.has_more,
        }


def page_after(items: Sequence[dict[str, Any]], after: str | None, limit: int, order: str) -> Page:
    """The page of ``items`` (oldest first, each with an ``id``) that follows ``after`` in
    ``order`` (``asc`` or ``desc``), at most ``limit`` long.

    Raises:
        NotFound: ``after`` is not the id of one of ``items`` (kind ``item``).
    """
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise NotFound("item", after)
        start = ids.index(after) + 1
    window = ordered[start : start + limit]
    return Page(window, start + limit < len(ordered))
