"""Stored responses and conversations in the store (`trio_llm.store.responses`,
`trio_llm.store.conversations`) against a fresh SQLite store, and the checks of their
API's parameters (list queries, conversation items and metadata)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from starlette.requests import Request

from trio_llm.api.http.errors import APIError
from trio_llm.api.http.store_routes import ListParams
from trio_llm.api.responses.conversations import ConversationCreateRequest
from trio_llm.api.responses.items import context_items, stored_items
from trio_llm.api.responses.request import check_items
from trio_llm.store import Evicted, NotFound, RetentionPolicy, Store, conversations, responses
from trio_llm.store.responses import StoredResponse
from trio_llm.store.retention import sweep


def _response(
    response_id: str, status: str = "completed", *, created_at: int = 100, **fields: Any
) -> StoredResponse:
    body = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": fields.pop("background", False),
        "model": "m",
        "output": [{"type": "message", "id": f"msg_out_{response_id}", "role": "assistant"}],
        **fields,
    }
    context = [{"type": "message", "id": f"msg_{k}", "role": "user"} for k in range(5)]
    return StoredResponse(response_id, body, {"input": "x", "model": "m"}, context)


def test_a_stored_response_reads_back_as_written(store: Store) -> None:
    stored = _response("resp_1", conversation={"id": "conv_1"}, previous_response_id="resp_0")
    store.transaction_sync(lambda tx: responses.insert(tx, stored))
    found = store.transaction_sync(lambda tx: responses.get(tx, "resp_1"))
    assert found == stored
    assert (found.conversation_id, found.status, found.active) == ("conv_1", "completed", False)
    assert found.continuation() == [*stored.context, *stored.body["output"]]
    row = store.transaction_sync(
        lambda tx: tx.one("SELECT previous_response_id, conversation_id FROM responses")
    )
    assert tuple(row) == ("resp_0", "conv_1")


def test_update_writes_only_an_active_response(store: Store) -> None:
    queued = _response("resp_bg", "queued", background=True)
    store.transaction_sync(lambda tx: responses.insert(tx, queued))
    left = store.transaction_sync(lambda tx: responses.unfinished(tx, store.runner))
    assert [r.id for r in left] == ["resp_bg"]
    running = queued.with_body({**queued.body, "status": "in_progress"})
    assert store.transaction_sync(lambda tx: responses.update(tx, running))
    done = StoredResponse("resp_bg", {**queued.body, "status": "cancelled"}, {}, [], resumed=1)
    assert store.transaction_sync(lambda tx: responses.update(tx, done))
    late = queued.with_body({**queued.body, "status": "completed"})
    assert not store.transaction_sync(lambda tx: responses.update(tx, late))
    found = store.transaction_sync(lambda tx: responses.get(tx, "resp_bg"))
    assert (found.status, found.resumed) == ("cancelled", 1)
    assert store.transaction_sync(lambda tx: responses.unfinished(tx, store.runner)) == []


def test_input_items_pages_and_unknown_ids(store: Store) -> None:
    store.transaction_sync(lambda tx: responses.insert(tx, _response("resp_1")))

    def ids(after: str | None, limit: int, order: str) -> tuple[list[str], bool]:
        page = store.transaction_sync(
            lambda tx: responses.input_items(tx, "resp_1", after, limit, order)
        )
        return [item["id"] for item in page.data], page.has_more

    assert ids(None, 2, "desc") == (["msg_4", "msg_3"], True)
    assert ids("msg_3", 2, "desc") == (["msg_2", "msg_1"], True)
    assert ids("msg_1", 20, "asc") == (["msg_2", "msg_3", "msg_4"], False)
    with pytest.raises(NotFound, match="no item with id 'msg_x'"):
        ids("msg_x", 2, "asc")
    with pytest.raises(NotFound, match="no response with id 'resp_2'"):
        store.transaction_sync(lambda tx: responses.get(tx, "resp_2"))
    store.transaction_sync(lambda tx: responses.delete(tx, "resp_1"))
    with pytest.raises(NotFound):
        store.transaction_sync(lambda tx: responses.delete(tx, "resp_1"))


def test_an_evicted_response_or_conversation_says_so(store: Store) -> None:
    def fill(tx) -> None:
        responses.insert(tx, _response("resp_old", created_at=1))
        conversations.create(tx, {}, [])

    store.transaction_sync(fill)
    conversation_id = store.transaction_sync(lambda tx: tx.one("SELECT id FROM conversations"))[0]
    store.transaction_sync(lambda tx: tx.execute("UPDATE conversations SET created_at = 1"))
    policy = RetentionPolicy(max_age=86400.0)
    removed = store.transaction_sync(lambda tx: sweep(tx, policy, at=10 * 86400))
    assert {kind for kind, _ in removed} == {"response", "conversation"}
    with pytest.raises(Evicted, match=r"no longer stored.*--store-retention 1d"):
        store.transaction_sync(lambda tx: responses.get(tx, "resp_old"))
    with pytest.raises(Evicted, match=f"conversation '{conversation_id}' is no longer stored"):
        store.transaction_sync(lambda tx: conversations.items(tx, conversation_id))


def test_a_conversation_holds_its_items_in_order(store: Store) -> None:
    items = stored_items(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    created = store.transaction_sync(lambda tx: conversations.create(tx, {"k": "v"}, items))
    cid = created["id"]
    assert created == {
        "id": cid,
        "object": "conversation",
        "created_at": created["created_at"],
        "metadata": {"k": "v"},
    }
    assert store.transaction_sync(lambda tx: conversations.items(tx, cid)) == items
    # An item sent again with its id is added again, under a new id.
    again = store.transaction_sync(lambda tx: conversations.add_items(tx, cid, items[:1]))
    assert again[0]["id"] != items[0]["id"] and again[0]["id"].startswith("msg_")
    every = [i["id"] for i in store.transaction_sync(lambda tx: conversations.items(tx, cid))]
    assert every == [items[0]["id"], items[1]["id"], again[0]["id"]]

    def page(after: str | None, limit: int, order: str) -> list[str]:
        found = store.transaction_sync(
            lambda tx: conversations.list_items(tx, cid, after, limit, order)
        )
        return [i["id"] for i in found.data] + (["..."] if found.has_more else [])

    assert page(None, 2, "desc") == [every[2], every[1], "..."]
    assert page(every[1], 2, "desc") == [every[0]]
    assert page(every[0], 5, "asc") == every[1:]
    with pytest.raises(NotFound, match="no item"):
        page("msg_nope", 5, "asc")

    assert store.transaction_sync(lambda tx: conversations.get_item(tx, cid, every[1])) == items[1]
    after_delete = store.transaction_sync(lambda tx: conversations.delete_item(tx, cid, every[1]))
    assert after_delete["id"] == cid
    with pytest.raises(NotFound, match="no conversation item"):
        store.transaction_sync(lambda tx: conversations.get_item(tx, cid, every[1]))
    updated = store.transaction_sync(lambda tx: conversations.update(tx, cid, {"a": "b"}))
    assert updated["metadata"] == {"a": "b"}
    store.transaction_sync(lambda tx: conversations.delete(tx, cid))
    for work in (conversations.get, conversations.items, conversations.delete):
        with pytest.raises(NotFound, match=f"no conversation with id '{cid}'"):
            store.transaction_sync(lambda tx, work=work: work(tx, cid))
    left = store.transaction_sync(lambda tx: tx.one("SELECT COUNT(*) FROM conversation_items"))
    assert left[0] == 0


def test_input_becomes_stored_items_the_chat_path_reads_the_same() -> None:
    assert stored_items("hi")[0] | {"id": "x"} == {
        "type": "message",
        "id": "x",
        "role": "user",
        "content": [{"type": "input_text", "text": "hi"}],
        "status": "completed",
    }
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1"}
    items = stored_items([{"role": "assistant", "content": "a"}, call])
    assert items[0]["content"] == [{"type": "output_text", "text": "a"}]
    assert items[1] == {**call, "status": "completed"}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    assert context_items([reasoning, *items]) == items


def _request(query: str) -> Request:
    return Request({"type": "http", "query_string": query.encode(), "headers": []})


@pytest.mark.parametrize(
    ("query", "param"),
    [("limit=0", "limit"), ("limit=101", "limit"), ("limit=ten", "limit"), ("order=up", "order")],
)
def test_bad_list_params_are_a_400_naming_them(query: str, param: str) -> None:
    with pytest.raises(APIError) as raised:
        ListParams.of(_request(query))
    assert (raised.value.status, raised.value.param) == (400, param)


def test_list_params_defaults_are_openais() -> None:
    assert ListParams.of(_request("")) == ListParams(None, 20, "desc")
    assert ListParams.of(_request("after=msg_1&limit=100&order=asc")) == ListParams(
        "msg_1", 100, "asc"
    )


async def test_an_unknown_after_is_a_400_naming_it(store: Store) -> None:
    store.transaction_sync(lambda tx: responses.insert(tx, _response("resp_1")))
    params = ListParams("msg_nope", 5, "asc")
    with pytest.raises(APIError) as raised:
        await params.page(store, partial(responses.input_items, response_id="resp_1"))
    assert (raised.value.status, raised.value.param) == (400, "after")
    with pytest.raises(NotFound):  # an unknown response is the store's 404
        await params.page(store, partial(responses.input_items, response_id="resp_2"))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "16 key-value pairs"),
        ({"metadata": {"k": "v" * 513}}, "at most 512"),
        ({"items": [{"role": "user", "content": "x"}] * 21}, "at most 20 items"),
    ],
)
def test_conversation_limits_are_openais(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ConversationCreateRequest.model_validate(body)


@pytest.mark.parametrize(
    "item",
    [
        {"type": "computer_call", "id": "x"},
        {"role": "robot", "content": "x"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]},
        {"role": "user", "content": "\ud800"},
    ],
)
def test_conversation_items_the_chat_path_cannot_read_are_refused(item: dict[str, Any]) -> None:
    with pytest.raises(APIError) as raised:
        check_items([{"role": "user", "content": "fine"}, item], "items")
    assert (raised.value.status, raised.value.param) == (400, "items")
