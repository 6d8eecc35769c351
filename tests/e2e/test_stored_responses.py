"""Stored responses, ``previous_response_id``, background responses and conversations
through the official openai SDK, against one server with its own store (``--store-url
sqlite:///<tmp>``); the last test stops it and starts another on the same store, which
still serves and continues the stored responses and finishes the background response the
first one left.

Continuations are checked by greedy equality: a response continuing a stored one says
what a stateless request sending the whole conversation says (same prompt tokens, same
text), so the context was rebuilt as a client would send it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.e2e.conftest import MODEL, openai_client
from tests.e2e.test_metrics import _delta, _scrape
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess, serve_until_it_exits

#: A prompt a small model answers at length (a cancelled run must still be running).
COUNTING = "Count from 1 to 1000, one number per line, with no other text."
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}


def _server(store_url: str, log: Path) -> ServerProcess:
    return ServerProcess(
        [*SMALL_SERVER_ARGS, "--dtype", "float32", "--store-url", store_url], log_path=log
    )


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('responses-store') / 'store.db'}"


@pytest.fixture(scope="module")
def first_server(
    store_url: str, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Iterator[ServerProcess]:
    """The module's server (the restart test stops it and starts another)."""
    process = _server(store_url, tmp_path_factory.mktemp("first") / "server.log")
    with process:
        yield process


@pytest.fixture
def client(first_server: ServerProcess) -> Iterator[OpenAI]:
    with openai_client(first_server.url) as openai:
        yield openai


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _poll(client: OpenAI, response_id: str, until: tuple[str, ...], timeout: float = 240):
    """Retrieve ``response_id`` until its status is one of ``until``."""
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            assert response.status in until, response
            return response
        time.sleep(0.05)


def test_a_continuation_says_what_the_whole_conversation_says(client: OpenAI) -> None:
    first = client.responses.create(
        input="What is the capital of France?",
        instructions="Answer in one short sentence.",
        max_output_tokens=24,
        **GREEDY,
    )
    assert (first.store, first.previous_response_id, first.background) == (True, None, False)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    follow_up = "And of Italy?"
    second = client.responses.create(
        previous_response_id=first.id, input=follow_up, max_output_tokens=24, **GREEDY
    )
    # The instructions are not carried over (OpenAI's rule): the reference sends none.
    whole = [
        _user("What is the capital of France?"),
        {"role": "assistant", "content": first.output_text},
        _user(follow_up),
    ]
    stateless = client.responses.create(input=whole, store=False, max_output_tokens=24, **GREEDY)
    assert second.previous_response_id == first.id and second.store is True
    assert second.instructions is None and stateless.store is False
    assert second.usage.input_tokens == stateless.usage.input_tokens
    assert second.output_text == stateless.output_text
    with pytest.raises(NotFoundError):
        client.responses.retrieve(stateless.id)

    # A continuation of a continuation: its prompt begins with the last one's, whose
    # blocks the prefix cache holds.
    third = client.responses.create(
        previous_response_id=second.id, input="Thanks!", max_output_tokens=8, **GREEDY
    )
    assert third.usage.input_tokens_details.cached_tokens >= 16

    # Its input items: the whole context, each with an id, newest first by default.
    items = list(client.responses.input_items.list(third.id, limit=2))
    texts = [item.content[0].text for item in items]
    assert texts == [
        "Thanks!",
        second.output_text,
        follow_up,
        first.output_text,
        whole[0]["content"],
    ]
    assert [item.role for item in items] == ["user", "assistant", "user", "assistant", "user"]
    assert len({item.id for item in items}) == 5 and all(item.id for item in items)
    page = client.responses.input_items.list(third.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [items[4].id, items[3].id] and page.has_more
    page = client.responses.input_items.list(third.id, order="asc", after=items[3].id, limit=10)
    assert [item.id for item in page.data] == [items[2].id, items[1].id, items[0].id]
    assert not page.has_more


def test_a_deleted_response_is_not_found(client: OpenAI) -> None:
    response = client.responses.create(input="Say hi.", max_output_tokens=4, **GREEDY)
    deleted = client.responses.delete(response.id)  # the SDK returns None for its 200
    assert deleted is None
    with pytest.raises(NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(BadRequestError) as raised:
        client.responses.create(previous_response_id=response.id, input="and?", model=MODEL)
    assert raised.value.code == "previous_response_not_found"
    assert raised.value.param == "previous_response_id"


def test_a_background_response_is_polled_until_completed(client: OpenAI) -> None:
    question = "Name a colour."
    queued = client.responses.create(
        input=question, background=True, max_output_tokens=12, **GREEDY
    )
    assert (queued.status, queued.background, queued.store) == ("queued", True, True)
    done = _poll(client, queued.id, ("completed", "incomplete"))
    foreground = client.responses.create(
        input=question, store=False, max_output_tokens=12, **GREEDY
    )
    assert done.output_text == foreground.output_text and done.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()  # ended


def test_cancel_stops_the_engine_request(client: OpenAI, first_server: ServerProcess) -> None:
    before = _scrape(first_server.url)
    limit = 900
    queued = client.responses.create(
        input=COUNTING, background=True, max_output_tokens=limit, **GREEDY
    )
    _poll(client, queued.id, ("in_progress",))
    # A few tokens (a background response runs in the batch lane, held to small steps
    # for a while after the module's interactive requests: no fixed sleep is enough).
    deadline = time.monotonic() + 120
    while _delta(before, _scrape(first_server.url), "trio_llm:generation_tokens_total") < 3:
        assert time.monotonic() < deadline, "no token generated"
        time.sleep(0.05)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).model_dump() == cancelled.model_dump()
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < limit
    assert _delta(before, _scrape(first_server.url), "trio_llm:request_aborted_total") == 1
    # The engine is free: the next request is served.
    assert client.responses.create(input="Hi", max_output_tokens=2, **GREEDY).status


def test_a_conversation_is_the_context_and_keeps_the_turns(client: OpenAI) -> None:
    fact = "My name is Ada."
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": fact}], metadata={"topic": "names"}
    )
    assert conversation.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conversation.id).model_dump() == conversation.model_dump()
    updated = client.conversations.update(conversation.id, metadata={"topic": "people"})
    assert updated.metadata == {"topic": "people"}

    question = "What is my name?"
    response = client.responses.create(
        conversation=conversation.id, input=question, max_output_tokens=16, **GREEDY
    )
    assert response.conversation is not None and response.conversation.id == conversation.id
    stateless = client.responses.create(
        input=[_user(fact), _user(question)], store=False, max_output_tokens=16, **GREEDY
    )
    assert response.output_text == stateless.output_text

    items = client.conversations.items.list(conversation.id, order="asc")
    assert [(item.type, item.role) for item in items.data] == [
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items.data[2].id == response.output[0].id

    added = client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "Bye."}]
    )
    (item,) = added.data
    got = client.conversations.items.retrieve(item.id, conversation_id=conversation.id)
    assert got.model_dump() == item.model_dump()
    client.conversations.items.delete(item.id, conversation_id=conversation.id)
    with pytest.raises(NotFoundError):
        client.conversations.items.retrieve(item.id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id, limit=2).data) == 2

    with pytest.raises(BadRequestError) as raised:
        client.responses.create(
            conversation=conversation.id, previous_response_id=response.id, input="x", model=MODEL
        )
    assert raised.value.param == "conversation"
    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.id == conversation.id
    with pytest.raises(NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(NotFoundError):
        client.responses.create(conversation=conversation.id, input="x", model=MODEL)


def test_an_unknown_previous_response_is_a_400_naming_it(first_server: ServerProcess) -> None:
    # (the stateful fields' other 400s are in test_responses_api's BAD)
    body = {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}
    reply = httpx.post(f"{first_server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (
        "previous_response_id",
        "previous_response_not_found",
    )


def test_the_stored_routes_refuse_what_they_cannot_do(
    client: OpenAI, first_server: ServerProcess
) -> None:
    response = client.responses.create(input="hi", max_output_tokens=2, **GREEDY)
    url = f"{first_server.url}/v1/responses/{response.id}"
    with pytest.raises(BadRequestError):  # only a background response can be cancelled
        client.responses.cancel(response.id)
    assert httpx.get(url, params={"stream": "true"}, timeout=30).status_code == 400
    for query, param in (
        ({"limit": 0}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "x"}, "after"),
    ):
        reply = httpx.get(f"{url}/input_items", params=query, timeout=30)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, param), reply.text
    assert httpx.get(f"{first_server.url}/v1/responses/resp_nope", timeout=30).status_code == 404


def test_a_store_url_under_a_file_stops_the_start_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    url = f"sqlite:///{tmp_path}/afile/store.db"
    done = serve_until_it_exits("--store-url", url)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"trio-llm: error: --store-url {url}: cannot make the store's folder "
        f"{tmp_path}/afile: {tmp_path}/afile is a file, not a folder"
    )


@pytest.mark.long
def test_stored_responses_survive_a_restart(
    client: OpenAI,
    first_server: ServerProcess,
    store_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Last in the module: it stops the module's server."""
    stored = client.responses.create(input="What is 2 + 2?", max_output_tokens=12, **GREEDY)
    left = client.responses.create(input=COUNTING, background=True, max_output_tokens=300, **GREEDY)
    _poll(client, left.id, ("in_progress",))
    assert first_server.stop() == 0  # SIGINT: the background response is left in progress

    with _server(store_url, tmp_path_factory.mktemp("second") / "server.log") as second:
        with openai_client(second.url) as again:
            assert again.responses.retrieve(stored.id).model_dump() == stored.model_dump()
            follow_up = again.responses.create(
                previous_response_id=stored.id, input="And 3 + 3?", max_output_tokens=12, **GREEDY
            )
            assert follow_up.status == "completed" and follow_up.output_text
            resumed = _poll(again, left.id, ("completed", "incomplete"))
            assert resumed.usage.output_tokens > 0 and resumed.output_text
        assert "background responses a stopped server left: run again" in second.log()
