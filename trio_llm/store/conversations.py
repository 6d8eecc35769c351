"""Conversations (OpenAI's Conversations API): units of work on the ``conversations`` and
``conversation_items`` tables.

A conversation is an ordered list of items (messages, function calls and their outputs,
reasoning items, each with an ``id`` unique in the store; ``seq`` orders them) and
``metadata``; a response created with ``conversation`` reads its items as the context
(`context`) and appends its input and output items (`add_items`). The conversation
object is OpenAI's ``{"id", "object": "conversation", "created_at", "metadata"}``.

A conversation is bounded (`ConversationLimits`: items and bytes, every item counted,
reasoning items too): an append that would pass a limit is refused whole
(`ConversationFull`), the conversation unchanged.

A stored response refers to the items it was generated from instead of copying them
(`trio_llm.store.responses`: the conversation's items before a ``seq``, its *bound*).
So that its ``input_items`` stay what they were, an item deleted while a stored response
still lists it is hidden (``hidden_at``: the conversation's ``next_seq`` then, which the
deletion moves on) instead of removed, and so is a deleted or evicted conversation
(``hidden``): the Conversations API no longer shows them, the responses that list them
still read them (`items_before`), and they go, with their bytes, once no stored response
lists them (`collect`, after a response is deleted or evicted). Their bytes count in the
store's size and the conversation's limits meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trio_llm.store.database import StoreError, Transaction
from trio_llm.store.objects import NotFound, Page, dumps, loads, missing, new_id, now, row_of

#: The prefix of conversation ids.
ID_PREFIX = "conv_"

#: Items a stored response reads from a conversation: those before its bound that were
#: not deleted before it was made (the bound is the ``?`` given twice).
_BEFORE = "seq < ? AND (hidden_at IS NULL OR hidden_at >= ?)"


@dataclass(frozen=True)
class ConversationLimits:
    """How large one conversation may grow (``--max-conversation-items``,
    ``--max-conversation-size``).

    Attributes:
        max_items: most items it stores; None: no limit.
        max_bytes: most bytes of its items' JSON and its metadata; None: no limit.
    """

    max_items: int | None = None
    max_bytes: int | None = None


class ConversationFull(StoreError):
    """Adding items would pass a `ConversationLimits` limit (nothing was added); the
    message names the limit and its flag. ``param`` names the request field at fault
    (the API sets it)."""

    def __init__(self, message: str, param: str = "items") -> None:
        super().__init__(message)
        self.param = param


def _body(conversation_id: str, created_at: int, metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata,
    }


def create(
    tx: Transaction,
    metadata: dict[str, Any],
    items: list[dict[str, Any]],
    limits: ConversationLimits | None = None,
) -> dict[str, Any]:
    """Store a new conversation holding ``items`` (each with an ``id``); return it.

    Raises:
        ConversationFull: ``items`` pass ``limits`` (None: no limit).
    """
    conversation_id, created_at = new_id(ID_PREFIX), now()
    text = dumps(metadata)
    tx.execute(
        "INSERT INTO conversations (id, created_at, metadata, next_seq, nbytes) "
        "VALUES (?, ?, ?, 0, ?)",
        (conversation_id, created_at, text, len(text.encode())),
    )
    add_items(tx, conversation_id, items, limits)
    return _body(conversation_id, created_at, metadata)


def get(tx: Transaction, conversation_id: str) -> dict[str, Any]:
    """The conversation object.

    Raises:
        NotFound: no such conversation (`Evicted` where the retention removed it).
    """
    sql = "SELECT created_at, metadata FROM conversations WHERE id = ? AND hidden = 0"
    row = row_of(tx, "conversation", sql, conversation_id)
    return _body(conversation_id, int(row[0]), loads(row[1]))


def exists(tx: Transaction, conversation_id: str) -> bool:
    """Whether the conversation is stored (not deleted, not evicted)."""
    sql = "SELECT 1 FROM conversations WHERE id = ? AND hidden = 0"
    return tx.one(sql, (conversation_id,)) is not None


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
    """Delete a conversation and its items (hide them, while a stored response lists
    some: see the module doc).

    Raises:
        NotFound: no such conversation.
    """
    get(tx, conversation_id)
    _remove(tx, conversation_id)


def _remove(tx: Transaction, conversation_id: str) -> None:
    """Delete the conversation, or hide it while a stored response lists its items."""
    if tx.one("SELECT 1 FROM responses WHERE context_conversation = ?", (conversation_id,)):
        tx.execute("UPDATE conversations SET hidden = 1 WHERE id = ?", (conversation_id,))
        return
    tx.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
    tx.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))


def evict(tx: Transaction, conversation_id: str) -> bool:
    """The retention's delete (`trio_llm.store.retention`): as `delete`, for a
    conversation that may be gone already; True if its bytes are free now (False while
    a stored response lists its items: they go with the last such response)."""
    _remove(tx, conversation_id)
    return tx.one("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)) is None


def check_room(
    tx: Transaction,
    conversation_id: str,
    items: list[dict[str, Any]],
    limits: ConversationLimits | None,
) -> None:
    """Raise if adding ``items`` would pass ``limits``.

    Raises:
        NotFound: no such conversation.
        ConversationFull: it would (the message names the limit and its flag).
    """
    row = tx.one(
        "SELECT nbytes, (SELECT COUNT(*) FROM conversation_items WHERE conversation_id = ?) "
        "FROM conversations WHERE id = ? AND hidden = 0",
        (conversation_id, conversation_id),
    )
    if row is None:
        raise missing(tx, "conversation", conversation_id)
    if limits is None:
        return
    nbytes, count = int(row[0]), int(row[1])
    if limits.max_items is not None and count + len(items) > limits.max_items:
        raise ConversationFull(
            f"the conversation '{conversation_id}' holds {count} items; adding {len(items)} "
            f"would pass this server's limit of {limits.max_items} items a conversation "
            "(--max-conversation-items): start a new conversation"
        )
    added = sum(len(dumps(item).encode()) for item in items)
    if limits.max_bytes is not None and nbytes + added > limits.max_bytes:
        raise ConversationFull(
            f"the conversation '{conversation_id}' holds {nbytes} bytes; adding {added} "
            f"would pass this server's limit of {limits.max_bytes} bytes a conversation "
            "(--max-conversation-size; reasoning items count too): start a new conversation"
        )


def add_items(
    tx: Transaction,
    conversation_id: str,
    items: list[dict[str, Any]],
    limits: ConversationLimits | None = None,
) -> list[dict[str, Any]]:
    """Append ``items`` (each with an ``id``) to the conversation; return them as stored.
    An item whose id another stored item has gets a new id with the same prefix (so an
    item sent again, with the id it was given, is added again).

    Raises:
        NotFound: no such conversation.
        ConversationFull: ``items`` would pass ``limits`` (None: no limit); none added.
    """
    check_room(tx, conversation_id, items, limits)
    row = tx.one("SELECT next_seq FROM conversations WHERE id = ?", (conversation_id,))
    seq = int(row[0]) if row is not None else 0
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
    return context(tx, conversation_id)[0]


def context(tx: Transaction, conversation_id: str) -> tuple[list[dict[str, Any]], int]:
    """Every item of the conversation, oldest first, and its ``next_seq``: the bound a
    response generated from them refers to them by (`items_before`).

    Raises:
        NotFound: no such conversation.
    """
    sql = "SELECT next_seq FROM conversations WHERE id = ? AND hidden = 0"
    bound = int(row_of(tx, "conversation", sql, conversation_id)[0])
    rows = tx.rows(
        "SELECT item FROM conversation_items WHERE conversation_id = ? AND hidden_at IS NULL "
        "ORDER BY seq",
        (conversation_id,),
    )
    return [loads(row[0]) for row in rows], bound


def items_before(
    tx: Transaction,
    conversation_id: str,
    bound: int,
    *,
    after_seq: int | None = None,
    limit: int | None = None,
    order: str = "asc",
) -> list[tuple[int, dict[str, Any]]]:
    """``(seq, item)`` of the items a response bound at ``bound`` was generated from
    (deleted or hidden since, too), in ``order``, past ``after_seq`` in that order, at
    most ``limit`` (None: all). None if the conversation was removed since."""
    where, params = f"conversation_id = ? AND {_BEFORE}", [conversation_id, bound, bound]
    if after_seq is not None:
        where += " AND seq > ?" if order == "asc" else " AND seq < ?"
        params.append(after_seq)
    direction = "ASC" if order == "asc" else "DESC"
    sql = f"SELECT seq, item FROM conversation_items WHERE {where} ORDER BY seq {direction}"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return [(int(row[0]), loads(row[1])) for row in tx.rows(sql, params)]


def seq_before(tx: Transaction, conversation_id: str, bound: int, item_id: str) -> int | None:
    """The ``seq`` of ``item_id`` among the items a response bound at ``bound`` was
    generated from (`items_before`); None if it is not one of them."""
    row = tx.one(
        f"SELECT seq FROM conversation_items WHERE conversation_id = ? AND item_id = ? "
        f"AND {_BEFORE}",
        (conversation_id, item_id, bound, bound),
    )
    return None if row is None else int(row[0])


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
    where, params = "conversation_id = ? AND hidden_at IS NULL", [conversation_id]
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
    """Delete one item of the conversation (hide it, while a stored response lists it:
    see the module doc); return the conversation (OpenAI's answer).

    Raises:
        NotFound: no such conversation, or no such item in it.
    """
    item = get_item(tx, conversation_id, item_id)
    seq = _seq(tx, conversation_id, item_id)
    listed = tx.one(
        "SELECT 1 FROM responses WHERE context_conversation = ? AND context_seq > ?",
        (conversation_id, seq),
    )
    if listed is not None:
        tx.execute(
            "UPDATE conversation_items SET hidden_at = "
            "(SELECT next_seq FROM conversations WHERE id = ?) WHERE item_id = ?",
            (conversation_id, item_id),
        )
        # Responses made from now on are bound past it: they do not list it.
        tx.execute(
            "UPDATE conversations SET next_seq = next_seq + 1 WHERE id = ?", (conversation_id,)
        )
        return get(tx, conversation_id)
    tx.execute("DELETE FROM conversation_items WHERE item_id = ?", (item_id,))
    tx.execute(
        "UPDATE conversations SET nbytes = nbytes - ? WHERE id = ?",
        (len(dumps(item).encode()), conversation_id),
    )
    return get(tx, conversation_id)


#: Hidden items no stored response lists (`collect`).
_UNLISTED = (
    "hidden_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM responses r WHERE "
    "r.context_conversation = conversation_items.conversation_id AND "
    "r.context_seq > conversation_items.seq AND r.context_seq <= conversation_items.hidden_at)"
)
#: Hidden conversations no stored response lists (`collect`).
_UNLISTED_CONVERSATIONS = (
    "hidden = 1 AND NOT EXISTS "
    "(SELECT 1 FROM responses r WHERE r.context_conversation = conversations.id)"
)


def collect(tx: Transaction, conversation_id: str | None = None) -> None:
    """Remove what was only kept for stored responses that are gone (see the module
    doc): hidden items no stored response lists, then hidden conversations none lists;
    of ``conversation_id`` only, when given (after one response is deleted)."""
    items, unlisted, args = _UNLISTED, _UNLISTED_CONVERSATIONS, ()
    if conversation_id is not None:
        items += " AND conversation_id = ?"
        unlisted += " AND id = ?"
        args = (conversation_id,)
    rows = tx.rows(f"SELECT conversation_id, item FROM conversation_items WHERE {items}", args)
    freed: dict[str, int] = {}
    for owner, text in rows:
        freed[owner] = freed.get(owner, 0) + len(str(text).encode())
    tx.execute(f"DELETE FROM conversation_items WHERE {items}", args)
    for owner, nbytes in freed.items():
        tx.execute("UPDATE conversations SET nbytes = nbytes - ? WHERE id = ?", (nbytes, owner))
    for (owner,) in tx.rows(f"SELECT id FROM conversations WHERE {unlisted}", args):
        _remove(tx, str(owner))


def _seq(tx: Transaction, conversation_id: str, item_id: str) -> int:
    return int(_item_column(tx, "seq", conversation_id, item_id, "item"))


def _item_column(
    tx: Transaction, column: str, conversation_id: str, item_id: str, kind: str
) -> Any:
    """``column`` (``item`` or ``seq``) of one (not deleted) item of the conversation.

    Raises:
        NotFound: of ``kind``, when the conversation has no such item.
    """
    row = tx.one(
        f"SELECT {column} FROM conversation_items WHERE conversation_id = ? AND item_id = ? "
        "AND hidden_at IS NULL",
        (conversation_id, item_id),
    )
    if row is None:
        raise NotFound(kind, item_id)
    return row[0]
