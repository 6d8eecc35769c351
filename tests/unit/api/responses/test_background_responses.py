"""Background responses and conversations under hostile use, over an engine played by the
test (issue 41): a background response whose conversation is deleted while it runs, or
before a restart resumes it, ends ``failed``; background responses are a bounded queue
(a 429 past ``--max-background-responses``) that runs in the batch lane, below a
newcomer's interactive request, resumed ones too; a conversation is bounded, and the
responses that use it do not copy it into the store."""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from tests.unit.api.responses.test_stored_responses_api import (
    BODY,
    _client,
    _left_by_a_stopped_server,
    _poll,
    _Silent,
)
from tests.unit.engine.test_priority_scheduling import _scheduler, _step
from trio_llm.engine.request import Request
from trio_llm.messages import AddRequest
from trio_llm.store import ConversationLimits, Store, responses
from trio_llm.store.retention import stored_bytes


def _adds(fake: Any) -> list[AddRequest]:
    return [message for message in fake.received if isinstance(message, AddRequest)]


async def _until(client, response_id: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    """`_poll`, within 10 s (on main such a response stayed in progress for ever)."""
    with trio.fail_after(10):
        return await _poll(client, response_id, statuses)


async def test_a_background_response_whose_conversation_is_deleted_ends_failed(
    smol_tokenizer, store: Store
) -> None:
    async with _client(smol_tokenizer, store, _Silent) as (client, fake):
        first = {"type": "message", "role": "user", "content": "My name is Ada."}
        conversation = (await client.post("/v1/conversations", json={"items": [first]})).json()
        cid = conversation["id"]
        body = {**BODY, "background": True, "conversation": cid, "input": "Who am I?"}
        queued = (await client.post("/v1/responses", json=body)).json()
        await fake.wait_for_requests(1)
        await _until(client, queued["id"], ("in_progress",))
        assert (await client.delete(f"/v1/conversations/{cid}")).status_code == 200
        (request_id,) = fake.added
        await fake.output(request_id, "stop")
        failed = await _until(client, queued["id"], ("failed",))
        assert f"the conversation '{cid}' was deleted" in failed["error"]["message"]
        assert (await client.get(f"/v1/conversations/{cid}")).status_code == 404
        # What it was generated from is still listed.
        items = (await client.get(f"/v1/responses/{queued['id']}/input_items?order=asc")).json()
        texts = [item["content"][0]["text"] for item in items["data"]]
        assert texts == ["My name is Ada.", "Who am I?"]


async def test_a_resumed_background_response_whose_conversation_is_gone_ends_failed(
    smol_tokenizer, store: Store
) -> None:
    left = _left_by_a_stopped_server("resp_left", 0)
    left = left.with_body({**left.body, "conversation": {"id": "conv_gone"}})
    left = type(left)(
        left.id, left.body, {**left.request, "conversation": "conv_gone"}, left.context
    )
    store.transaction_sync(lambda tx: responses.insert(tx, left))
    async with _client(smol_tokenizer, store) as (client, fake):
        failed = await _until(client, "resp_left", ("failed",))
        assert "the conversation 'conv_gone' was deleted" in failed["error"]["message"]
        assert fake.added == []  # not generated again for nothing


async def test_background_responses_are_a_bounded_queue_in_the_batch_lane(
    smol_tokenizer, store: Store
) -> None:
    async with _client(smol_tokenizer, store, _Silent, max_background=2) as (client, fake):
        body = {**BODY, "background": True}
        for _ in range(2):
            assert (await client.post("/v1/responses", json=body)).json()["status"] == "queued"
        refused = await client.post("/v1/responses", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "requests",
            "rate_limit_exceeded",
            "background",
        )
        assert "--max-background-responses" in error["message"]
        await fake.wait_for_requests(2)
        async with trio.open_nursery() as nursery:
            newcomer = partial(client.post, "/v1/responses", json={**BODY, "store": False})
            nursery.start_soon(newcomer)
            await fake.wait_for_requests(3)
            nursery.cancel_scope.cancel()
    adds = _adds(fake)
    assert [add.scheduling.batch for add in adds] == [True, True, False]
    # The engine serves the newcomer ahead of the background responses already running.
    scheduler = _scheduler(max_num_seqs=2)
    for add in adds[:2]:
        scheduler.add(_engine_request(add))
    _step(scheduler)
    scheduler.add(_engine_request(adds[2]))
    assert adds[2].request_id in [r.request_id for r, _ in _step(scheduler).requests]


async def _statuses(client, count: int) -> list[str]:
    """The statuses of ``resp_0`` ... in order."""
    found = [(await client.get(f"/v1/responses/resp_{k}")).json()["status"] for k in range(count)]
    return sorted(found)


async def _statuses(client, count: int) -> list[str]:
    """The statuses of ``resp_0`` ... ``resp_{count - 1}``, sorted."""
    found = [(await client.get(f"/v1/responses/resp_{k}")).json()["status"] for k in range(count)]
    return sorted(found)


def _engine_request(add: AddRequest) -> Request:
    """The engine's request for ``add``, as `EngineCore.add_request` makes it."""
    scheduling = add.scheduling
    return Request(
        add.request_id,
        add.prompt_token_ids,
        add.params,
        add.group,
        priority=scheduling.priority,
        batch=scheduling.batch,
    )


async def test_resumed_background_responses_wait_their_turn_in_the_batch_lane(
    smol_tokenizer, store: Store
) -> None:
    store.transaction_sync(
        lambda tx: [
            responses.insert(tx, _left_by_a_stopped_server(f"resp_{k}", 0)) for k in range(3)
        ]
    )
    async with _client(smol_tokenizer, store, _Silent, max_background=1) as (client, fake):
        await fake.wait_for_requests(1)
        with trio.fail_after(10):  # the resume writes each in a worker thread
            while True:
                if await _statuses(client, 3) == ["in_progress", "queued", "queued"]:
                    break
                await trio.sleep(0.01)
        assert len(fake.added) == 1 and _adds(fake)[0].scheduling.batch
        await fake.output(fake.added[0], "stop")
        await fake.wait_for_requests(2)
        assert _adds(fake)[1].scheduling.batch


async def test_a_conversation_past_its_limits_is_a_400_naming_the_limit(
    smol_tokenizer, store: Store
) -> None:
    store.conversation_limits = ConversationLimits(max_items=4, max_bytes=None)
    async with _client(smol_tokenizer, store) as (client, fake):
        item = {"type": "message", "role": "user", "content": "hi"}
        cid = (await client.post("/v1/conversations", json={"items": [item] * 2})).json()["id"]
        reply = await client.post(f"/v1/conversations/{cid}/items", json={"items": [item] * 3})
        error = reply.json()["error"]
        assert reply.status_code == 400 and (error["param"], error["code"]) == (
            "items",
            "conversation_too_large",
        )
        assert "--max-conversation-items" in error["message"]
        # Its input would pass it: refused before it is generated.
        body = {**BODY, "conversation": cid, "input": [item] * 3}
        reply = await client.post("/v1/responses", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "conversation"
        assert fake.added == []
        # Its input and output would: refused once generated, nothing added.
        reply = await client.post("/v1/responses", json={**body, "input": [item] * 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "conversation"
        assert "--max-conversation-items" in reply.json()["error"]["message"]
        listed = (await client.get(f"/v1/conversations/{cid}/items")).json()["data"]
        assert len(listed) == 2
        # Room for one more turn exactly.
        reply = await client.post("/v1/responses", json={**body, "input": [item]})
        assert reply.status_code == 200, reply.text


async def test_responses_in_a_conversation_do_not_copy_it_into_the_store(
    smol_tokenizer, store: Store
) -> None:
    async with _client(smol_tokenizer, store) as (client, _):
        # Reasoning items: 20 kB each, never shown to the model.
        text = [{"type": "reasoning_text", "text": "thinking " * 2200}]
        items = [{"type": "reasoning", "summary": [], "content": text}] * 10
        cid = (await client.post("/v1/conversations", json={"items": items})).json()["id"]
        before = store.transaction_sync(stored_bytes)
        for turn in ("One?", "Two?"):
            body = {**BODY, "conversation": cid, "input": turn}
            reply = await client.post("/v1/responses", json=body)
            assert reply.status_code == 200, reply.text
        grown = store.transaction_sync(stored_bytes) - before
        assert grown < 20_000, grown  # on main: a copy of the 200 kB conversation each
        url = f"/v1/responses/{reply.json()['id']}/input_items"
        page = (await client.get(url, params={"limit": 1})).json()
        assert [item["content"][0]["text"] for item in page["data"]] == ["Two?"]
        assert page["has_more"]
        every = (await client.get(url, params={"limit": 100, "order": "asc"})).json()["data"]
        assert len(every) == 10 + 2 + 1  # the conversation, the first turn, its own input
