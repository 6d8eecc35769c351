"""Hostile clients of the store's features through the openai SDK, against one real server
with its own store (issue 41, items 1, 2, 9, 10): a batch line whose ``custom_id`` holds a
lone surrogate, a flood of background responses, a conversation deleted under a
background response, a conversation grown past its limit. Each harms only the request that
did it: the other lines, the newcomer, the conversation stay as they should.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError, NotFoundError, OpenAI, RateLimitError

from tests.e2e.conftest import MODEL, openai_client
from tests.e2e.test_stored_responses import COUNTING, _poll
from tests.support.batches import file_lines, line, start_batch, wait_for_batch
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess

#: Most background responses queued or in progress on the module's server.
MAX_BACKGROUND = 2
#: Most items of one of its conversations.
MAX_ITEMS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("hostile-store")
    args = [*SMALL_SERVER_ARGS, "--dtype", "float32", "--store-url", f"sqlite:///{folder}/s.db"]
    args += ["--max-background-responses", str(MAX_BACKGROUND)]
    args += ["--max-conversation-items", str(MAX_ITEMS)]
    process = ServerProcess(args, log_path=folder / "server.log")
    with process:
        yield process.url


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[OpenAI]:
    with openai_client(server) as openai:
        yield openai


def _completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}


def test_a_lone_surrogate_in_a_custom_id_harms_no_other_line(client: OpenAI) -> None:
    lines = [line(f"good-{k}", "/v1/completions", _completion(f"Say {k}")) for k in range(5)]
    lines.insert(2, line("bad\ud800id", "/v1/completions", _completion("Say x")))
    batch = wait_for_batch(client, start_batch(client, lines, "/v1/completions"))
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 6, 0)
    output = file_lines(client, batch.output_file_id)
    assert [item["custom_id"] for item in output] == [
        "good-0",
        "good-1",
        "bad\ud800id",  # written back as the escape it came as
        "good-2",
        "good-3",
        "good-4",
    ]


def test_a_background_flood_is_refused_past_the_limit_and_a_newcomer_is_served(
    client: OpenAI,
) -> None:
    flood = [
        client.responses.create(
            model=MODEL, input=COUNTING, background=True, max_output_tokens=200, temperature=0
        )
        for _ in range(MAX_BACKGROUND)
    ]
    with pytest.raises(RateLimitError) as refused:
        client.responses.create(model=MODEL, input=COUNTING, background=True)
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded", error
    assert "--max-background-responses" in error["message"]
    assert refused.value.response.headers["retry-after"] == "1"
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content
    for response in flood:
        client.responses.cancel(response.id)


def test_a_conversation_deleted_under_a_background_response_fails_it(client: OpenAI) -> None:
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}]
    )
    running = client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        input=COUNTING,
        background=True,
        max_output_tokens=200,  # seconds of work: it is deleted meanwhile
        temperature=0,
    )
    _poll(client, running.id, ("in_progress",))
    client.conversations.delete(conversation.id)
    ended = _poll(client, running.id, ("failed", "completed"))
    assert ended.status == "failed", ended
    assert ended.error is not None and conversation.id in ended.error.message
    assert "was deleted" in ended.error.message
    with pytest.raises(NotFoundError):
        client.conversations.retrieve(conversation.id)
    listed = list(client.responses.input_items.list(running.id, order="asc"))
    assert [item.content[0].text for item in listed] == ["My name is Ada.", COUNTING]


def test_a_conversation_past_its_limit_is_a_400_and_unchanged(client: OpenAI) -> None:
    items = [{"type": "message", "role": "user", "content": f"Fact {k}."} for k in range(4)]
    conversation = client.conversations.create(items=items)
    with pytest.raises(BadRequestError) as refused:
        client.conversations.items.create(conversation.id, items=items[:3])
    assert refused.value.body["param"] == "items"  # type: ignore[index]
    assert "--max-conversation-items" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(
            model=MODEL, conversation=conversation.id, input=items[:3], max_output_tokens=2
        )
    assert refused.value.body["param"] == "conversation"  # type: ignore[index]
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == 4
    answered = client.responses.create(
        model=MODEL, conversation=conversation.id, input="Hi", max_output_tokens=2
    )
    assert answered.status in ("completed", "incomplete")
    assert len(client.conversations.items.list(conversation.id, limit=100).data) == MAX_ITEMS
