"""Conversations in the store as responses use them (issue 41, item 9): a response refers
to its conversation's items instead of copying them, its ``input_items`` stay what they
were (items deleted later, the conversation deleted or evicted later) and are paged in
SQL, a conversation is bounded, and a database made by the previous schema reads as it
did. On the `store` fixture (SQLite, and PostgreSQL in the slow tier)."""

from __future__ import annotations

import itertools
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from trio_llm.api.responses.items import stored_items
from trio_llm.store import (
    ConversationFull,
    ConversationLimits,
    NotFound,
    RetentionPolicy,
    Store,
    conversations,
    open_store,
    responses,
)
from trio_llm.store.database import Transaction, open_database
from trio_llm.store.migrations import MIGRATIONS
from trio_llm.store.objects import dumps, page_after
from trio_llm.store.responses import StoredResponse, stored_response
from trio_llm.store.retention import stored_bytes, sweep


def _messages(count: int, size: int = 10, prefix: str = "m") -> list[dict[str, Any]]:
    return stored_items(
        [{"role": "user", "content": f"{prefix}{k}" + "x" * size} for k in range(count)]
    )


def _body(
    response_id: str, conversation_id: str | None, *, created_at: int = 100
) -> dict[str, Any]:
    output = [{"type": "message", "id": f"msg_out_{response_id}", "role": "assistant"}]
    body = {"id": response_id, "object": "response", "created_at": created_at}
    body |= {"status": "completed", "background": False, "model": "m", "output": output}
    if conversation_id is not None:
        body["conversation"] = {"id": conversation_id}
    return body


def _respond(
    tx: Transaction, response_id: str, conversation_id: str, own: list[dict[str, Any]], **kw: Any
) -> StoredResponse:
    """Store a response to ``own`` in the conversation, as `record` does: read its
    context, store the response referring to it, append its items."""
    context = _shared(tx, conversation_id)
    body = _body(response_id, conversation_id, **kw)
    stored = stored_response(response_id, body, {"input": "x"}, context, own)
    responses.insert(tx, stored)
    conversations.add_items(tx, conversation_id, [*own, *body["output"]])
    return stored


def _shared(tx: Transaction, conversation_id: str) -> list[dict[str, Any]]:
    items, bound = conversations.context(tx, conversation_id)
    return responses.SharedContext(items, responses.ContextRef(conversation_id, bound), len(items))


def _ids(items: list[dict[str, Any]]) -> list[str]:
    return [item["id"] for item in items]


def _every_page(store: Store, response_id: str, whole: list[dict[str, Any]]) -> None:
    """Every page `input_items` gives equals the page of the whole context."""
    for order, limit in itertools.product(("asc", "desc"), (1, 2, 3, 100)):
        for after in [None, *_ids(whole)]:
            work = partial(
                responses.input_items,
                response_id=response_id,
                after=after,
                limit=limit,
                order=order,
            )
            page = store.transaction_sync(work)
            assert page == page_after(whole, after, limit, order), (order, limit, after)


def test_a_response_refers_to_its_conversation_and_lists_it_as_it_was(store: Store) -> None:
    first = _messages(30, size=2000)
    cid = store.transaction_sync(lambda tx: conversations.create(tx, {}, first))["id"]
    own = _messages(2, prefix="own")
    before = store.transaction_sync(stored_bytes)
    stored = store.transaction_sync(lambda tx: _respond(tx, "resp_1", cid, own))
    # The response keeps its own items; the conversation's are kept once, in it.
    assert stored.context == own and stored.context_ref == (cid, 30)
    row = store.transaction_sync(lambda tx: tx.one("SELECT nbytes FROM responses"))
    assert row[0] < 4096
    grown = store.transaction_sync(stored_bytes) - before
    assert grown < 2 * 4096 + len(dumps(own)), grown  # not the 60 kB conversation again
    whole = [*first, *own]
    _every_page(store, "resp_1", whole)

    # Later turns, a deleted item, then the conversation deleted: its input items stay.
    store.transaction_sync(lambda tx: _respond(tx, "resp_2", cid, _messages(1, prefix="b")))
    store.transaction_sync(lambda tx: conversations.delete_item(tx, cid, first[3]["id"]))
    listed = store.transaction_sync(lambda tx: conversations.items(tx, cid))
    assert first[3]["id"] not in _ids(listed) and len(listed) == 30 - 1 + 3 + 2
    third = store.transaction_sync(lambda tx: _shared(tx, cid))
    assert first[3]["id"] not in _ids(third)  # a new response does not see it
    _every_page(store, "resp_1", whole)
    store.transaction_sync(lambda tx: conversations.delete(tx, cid))
    with pytest.raises(NotFound, match=f"no conversation with id '{cid}'"):
        store.transaction_sync(lambda tx: conversations.items(tx, cid))
    _every_page(store, "resp_1", whole)

    # A continuation of it refers to the same items; the whole context is read.
    previous, context = store.transaction_sync(lambda tx: responses.continuation(tx, "resp_1"))
    assert context == [*whole, *previous.body["output"]]
    follow = stored_response("resp_3", _body("resp_3", None), {}, context, _messages(1, prefix="c"))
    assert follow.context_ref == (cid, 30) and len(follow.context) == 2 + 1 + 1

    # Once no stored response lists them, the hidden items and conversation go.
    for response_id in ("resp_1", "resp_2"):
        store.transaction_sync(lambda tx, rid=response_id: responses.delete(tx, rid))
    left = store.transaction_sync(
        lambda tx: tx.one(
            "SELECT (SELECT COUNT(*) FROM conversations)"
            " + (SELECT COUNT(*) FROM conversation_items)"
        )
    )
    assert left[0] == 0


def test_input_items_read_a_page_not_the_whole_conversation(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    cid = store.transaction_sync(lambda tx: conversations.create(tx, {}, _messages(20)))["id"]
    for k in range(5):
        store.transaction_sync(lambda tx, k=k: _respond(tx, f"resp_{k}", cid, _messages(1)))
    read: list[int] = []
    real = conversations.items_before

    def counted(*args: Any, **kwargs: Any) -> list[tuple[int, dict[str, Any]]]:
        rows = real(*args, **kwargs)
        read.append(len(rows))
        return rows

    monkeypatch.setattr(conversations, "items_before", counted)
    for order in ("asc", "desc"):
        work = partial(responses.input_items, response_id="resp_4", after=None, limit=1)
        page = store.transaction_sync(partial(work, order=order))
        assert len(page.data) == 1 and page.has_more
    assert read and max(read) <= 2, read


def test_a_conversation_past_its_limits_is_refused_and_unchanged(store: Store) -> None:
    limits = ConversationLimits(max_items=4, max_bytes=4000)
    cid = store.transaction_sync(lambda tx: conversations.create(tx, {}, _messages(3), limits))[
        "id"
    ]
    with pytest.raises(ConversationFull, match=r"limit of 4 items.*--max-conversation-items"):
        store.transaction_sync(lambda tx: conversations.add_items(tx, cid, _messages(2), limits))
    # A reasoning item is never shown to the model, and counts all the same.
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": "r" * 5000}
    with pytest.raises(ConversationFull, match=r"4000 bytes.*--max-conversation-size"):
        store.transaction_sync(lambda tx: conversations.add_items(tx, cid, [reasoning], limits))
    assert len(store.transaction_sync(lambda tx: conversations.items(tx, cid))) == 3
    store.transaction_sync(lambda tx: conversations.add_items(tx, cid, _messages(1), limits))
    with pytest.raises(ConversationFull):
        store.transaction_sync(lambda tx: conversations.create(tx, {}, _messages(5), limits))


def test_evicting_a_conversation_a_response_lists_frees_it_with_the_response(
    store: Store,
) -> None:
    cid = store.transaction_sync(lambda tx: conversations.create(tx, {}, _messages(10, 3000)))["id"]
    store.transaction_sync(lambda tx: tx.execute("UPDATE conversations SET created_at = 1"))
    store.transaction_sync(lambda tx: _respond(tx, "resp_1", cid, _messages(1), created_at=2))
    newest = _body("resp_new", None, created_at=3)
    store.transaction_sync(
        lambda tx: responses.insert(tx, StoredResponse("resp_new", newest, {}, []))
    )
    # Room for the newest response only: the conversation and its response go (the
    # conversation's bytes are free once the response that lists it is gone); the
    # newest response stays.
    total = store.transaction_sync(stored_bytes)
    policy = RetentionPolicy(max_age=None, max_bytes=total - 30_000)
    removed = store.transaction_sync(lambda tx: sweep(tx, policy))
    assert removed == [("conversation", cid), ("response", "resp_1")]
    assert store.transaction_sync(lambda tx: responses.get(tx, "resp_new")).id == "resp_new"
    count = store.transaction_sync(lambda tx: tx.one("SELECT COUNT(*) FROM conversation_items"))
    assert count[0] == 0

    # Evicted alone (its response kept): hidden, the response still lists its items.
    cid = store.transaction_sync(lambda tx: conversations.create(tx, {}, _messages(3)))["id"]
    store.transaction_sync(lambda tx: tx.execute("UPDATE conversations SET created_at = 1"))
    store.transaction_sync(lambda tx: _respond(tx, "resp_2", cid, _messages(1), created_at=10**10))
    policy = RetentionPolicy(max_age=86400.0, max_bytes=None)
    removed = store.transaction_sync(lambda tx: sweep(tx, policy, at=10 * 86400))
    assert removed == [("conversation", cid), ("response", "resp_new")]
    page = store.transaction_sync(lambda tx: responses.input_items(tx, "resp_2", None, 10, "asc"))
    assert len(page.data) == 4


def _schema_2_store(url: str, tmp_path: Path) -> None:
    """A store as a server of schema 2 left it: a conversation, and a response in it
    holding a copy of its context."""
    database = open_database(url, tmp_path)

    def build(tx: Transaction) -> None:
        tx.execute("CREATE TABLE store_schema (version BIGINT NOT NULL)")
        for version, statements in enumerate(MIGRATIONS[:2], start=1):
            for statement in statements:
                tx.execute(statement)
            tx.execute("INSERT INTO store_schema (version) VALUES (?)", (version,))
        items = _messages(3)
        tx.execute(
            "INSERT INTO conversations (id, created_at, metadata, next_seq, nbytes) "
            "VALUES ('conv_old', 1, '{}', 3, 0)"
        )
        for seq, item in enumerate(items):
            tx.execute(
                "INSERT INTO conversation_items (conversation_id, seq, item_id, item) "
                "VALUES ('conv_old', ?, ?, ?)",
                (seq, item["id"], dumps(item)),
            )
        context = [*items, *_messages(1, prefix="own")]
        tx.execute(
            "INSERT INTO responses (id, created_at, status, background, model, "
            "previous_response_id, conversation_id, request, context, body, nbytes, runner) "
            "VALUES ('resp_old', 1, 'completed', 0, 'm', NULL, 'conv_old', ?, ?, ?, 0, NULL)",
            (
                dumps({"body": {"input": "x"}, "resumed": 0}),
                dumps(context),
                dumps(_body("resp_old", "conv_old")),
            ),
        )

    try:
        database.transaction_sync(build)
    finally:
        database.close()


def test_a_store_of_the_previous_schema_reads_as_it_did(store_url: str, tmp_path: Path) -> None:
    _schema_2_store(store_url, tmp_path)
    store = open_store(store_url, tmp_path)
    try:
        old = store.transaction_sync(lambda tx: responses.get(tx, "resp_old"))
        assert old.context_ref is None and len(old.context) == 4
        _every_page(store, "resp_old", old.context)
        _, context = store.transaction_sync(lambda tx: responses.continuation(tx, "resp_old"))
        assert context == [*old.context, *old.body["output"]]
        # The old conversation takes new responses, which refer to it.
        new = store.transaction_sync(lambda tx: _respond(tx, "resp_new", "conv_old", _messages(1)))
        assert new.context_ref == ("conv_old", 3)
        _every_page(store, "resp_new", [*old.context[:3], *new.context])
        store.transaction_sync(lambda tx: responses.delete(tx, "resp_new"))
        store.transaction_sync(partial(conversations.delete, conversation_id="conv_old"))
        _every_page(store, "resp_old", old.context)  # its copy
    finally:
        store.close()
