"""Conversations (OpenAI's Conversations API): units of work on the ``conversations`` and
``conversation_items`` tables.

A conversation is an ordered list of items (messages, function calls and their outputs,
each with an ``id`` unique in the store) and ``metadata``; a response created with
``conversation`` reads its items as the context and appends its input and output items
(`add_items`). The conversation object is OpenAI's ``{"id", "object": "conversation",
"created_at", "metadata"}``. Deleting a conversation deletes its items (``ON DELETE
CASCADE``); so does the retention, which counts a conversation's bytes with its items'.
"""

from __future__ import annotations

from typing import Any

from trio_llm.store.database import Transaction
from trio_llm.store.objects import NotFound, Page, dumps, loads, missing, new_id, now, row_of

#: The prefix of conversation ids.
ID_PREFIX = "conv_"


def _body(conversation_id: str, created_at: int, metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata,
    }


def create(
    tx: Transaction, metadata: dict[str, Any], items: list[dict[str, Any]]
) -> dict[str, Any]:
    """Store a new conversation holding ``items`` (each with an ``id``); return it."""
    conversation_id, created_at = new_id(ID_PREFIX), now()
    text = dumps(metadata)
    tx.execute(
        "INSERT INTO conversations (id, created_at, metadata, next_seq, nbytes) "
        "VALUES (?, ?, ?, 0, ?)",
        (conversation_id, created_at, text, len(text.encode())),
    )
    add_items(tx, conversation_id, items)
    return _body(conversation_id, created_at, metadata)


def get(tx: Transaction, conversation_id: str) -> dict[str, Any]:
    """The conversation object.

    Raises:
        NotFound: no such conversation (`Evicted` where the retention removed it).
    """
    sql = "SELECT created_at, metadata FROM conversations WHERE id = ?"
    row = row_of(tx, "conversation", sql, conversation_id)
    return _body(conversation_id, int(row[0]), loads(row[1]))


def update(tx: Transaction, conversation_id: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """Replace the conversation's metadata; return the conversation.

    Raises:
        NotFound: no such conversation.
    """
    old = get(tx, conversation_id)
    new, before = dumps(metadata), dumps(old["metadata"])
    tx.execute(
        "UPDATE conversations SET metadata = ?, nbytes = nbytes + ? WHERE id = ?",
        (new, len(new.encode()) - len(before.encode()), conversation_id),
    )
    return {**old, "metadata": metadata}


def delete(tx: Transaction, conversation_id: str) -> None:
    """Delete a conversation and its items.

    Raises:
        NotFound: no such conversation.
    """
    tx.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
    if tx.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)) == 0:
        raise missing(tx, "conversation", conversation_id)


def add_items(
    tx: Transaction, conversation_id: str, items: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Append ``items`` (each with an ``id``) to the conversation; return them as stored.
    An item whose id another stored item has gets a new id with the same prefix (so an
    item sent again, with the id it was given, is added again).

    Raises:
        NotFound: no such conversation.
    """
    row = tx.one("SELECT next_seq FROM conversations WHERE id = ?", (conversation_id,))
    if row is None:
        raise missing(tx, "conversation", conversation_id)
    seq = int(row[0])
    stored, added = [], 0
    for item in items:
        item_id = str(item["id"])
        if tx.one("SELECT 1 FROM conversation_items WHERE item_id = ?", (item_id,)) is not None:
            item = {**item, "id": new_id(item_id.split("_", 1)[0] + "_")}
        text = dumps(item)
        tx.execute(
            "INSERT INTO conversation_items (conversation_id, seq, item_id, item) "
            "VALUES (?, ?, ?, ?)",
            (conversation_id, seq, item["id"], text),
        )
        seq += 1
        added += len(text.encode())
        stored.append(item)
    tx.execute(
        "UPDATE conversations SET next_seq = ?, nbytes = nbytes + ? WHERE id = ?",
        (seq, added, conversation_id),
    )
    return stored


def items(tx: Transaction, conversation_id: str) -> list[dict[str, Any]]:
    """Every item of the conversation, oldest first.

    Raises:
        NotFound: no such conversation.
    """
    get(tx, conversation_id)
    rows = tx.rows(
        "SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
        (conversation_id,),
    )
    return [loads(row[0]) for row in rows]


def list_items(
    tx: Transaction, conversation_id: str, after: str | None, limit: int, order: str
) -> Page:
    """One page of the conversation's items in ``order`` (``asc``: oldest first), after
    the item ``after``, at most ``limit`` long.

    Raises:
        NotFound: no such conversation, or ``after`` names none of its items (kind
            ``item``).
    """
    get(tx, conversation_id)
    where, params = "conversation_id = ?", [conversation_id]
    if after is not None:
        seq = _seq(tx, conversation_id, after)
        where += " AND seq > ?" if order == "asc" else " AND seq < ?"
        params.append(seq)
    direction = "ASC" if order == "asc" else "DESC"
    rows = tx.rows(
        f"SELECT item FROM conversation_items WHERE {where} ORDER BY seq {direction} LIMIT ?",
        (*params, limit + 1),
    )
    return Page([loads(row[0]) for row in rows[:limit]], len(rows) > limit)


def get_item(tx: Transaction, conversation_id: str, item_id: str) -> dict[str, Any]:
    """One item of the conversation.

    Raises:
        NotFound: no such conversation, or no such item in it.
    """
    get(tx, conversation_id)
    return loads(_item_column(tx, "item", conversation_id, item_id, "conversation item"))


def delete_item(tx: Transaction, conversation_id: str, item_id: str) -> dict[str, Any]:
    """Delete one item of the conversation; return the conversation (OpenAI's answer).

    Raises:
        NotFound: no such conversation, or no such item in it.
    """
    item = get_item(tx, conversation_id, item_id)
    tx.execute(
        "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
        (conversation_id, item_id),
    )
    tx.execute(
        "UPDATE conversations SET nbytes = nbytes - ? WHERE id = ?",
        (len(dumps(item).encode()), conversation_id),
    )
    return get(tx, conversation_id)


def _seq(tx: Transaction, conversation_id: str, item_id: str) -> int:
    return int(_item_column(tx, "seq", conversation_id, item_id, "item"))


def _item_column(
    tx: Transaction, column: str, conversation_id: str, item_id: str, kind: str
) -> Any:
    """``column`` (``item`` or ``seq``) of one item of the conversation.

    Raises:
        NotFound: of ``kind``, when the conversation has no such item.
    """
    row = tx.one(
        f"SELECT {column} FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
        (conversation_id, item_id),
    )
    if row is None:
        raise NotFound(kind, item_id)
    return row[0]
