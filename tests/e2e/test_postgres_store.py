"""``trio-llm serve --store-url postgresql://...``: two servers started at once on one
new PostgreSQL database (replicas behind a router) both start, the schema is migrated
once, both serve, a response stored by one is continued by the other, each batch runs
on one of them, and both stop with exit 0; a PostgreSQL nobody listens on fails the
start-up with a message that names ``--store-url``, not a traceback."""

from __future__ import annotations

import socket
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL, openai_client, parallel
from tests.support.batches import completion_lines, start_batch, wait_for_batch
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess, serve_until_it_exits
from trio_llm.store.migrations import SCHEMA_VERSION

psycopg = pytest.importorskip("psycopg")

#: Two servers share the machine: one compute thread each.
ARGS = [*SMALL_SERVER_ARGS, "--dtype", "float32", "--num-threads", "1"]


@pytest.mark.long
def test_two_servers_on_one_postgresql_store_migrate_once_and_serve(
    postgres_store_url: str, tmp_path: Path, real_model_dir: Path
) -> None:
    servers = [
        ServerProcess(
            [*ARGS, "--store-url", postgres_store_url], log_path=tmp_path / f"server{i}.log"
        )
        for i in range(2)
    ]
    try:
        parallel(*(server.start for server in servers))
        with psycopg.connect(postgres_store_url) as connection:
            versions = connection.execute("SELECT version FROM store_schema ORDER BY 1")
            assert [row[0] for row in versions] == list(range(1, SCHEMA_VERSION + 1))
            tables = connection.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            )
            assert {"responses", "files", "batches"} <= {row[0] for row in tables}
        for server in servers:
            with openai_client(server.url) as client:
                chat = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Say hello."}],
                    max_tokens=4,
                )
            assert chat.choices[0].message.content
            assert chat.usage is not None and chat.usage.completion_tokens >= 1
        _continue_on_the_other_replica(servers[0].url, servers[1].url)
        _each_batch_runs_on_one_replica([server.url for server in servers])
        assert [server.stop() for server in servers] == [0, 0]
    finally:
        for server in servers:
            server.close()
    migrated = [server.log().count(f"schema version 0 -> {SCHEMA_VERSION}") for server in servers]
    assert sorted(migrated) == [0, 1], [server.log() for server in servers]


def _continue_on_the_other_replica(first_url: str, second_url: str) -> None:
    """A response stored by one replica is read and continued by the other (a router may
    send a conversation's turns anywhere), and the continuation says what the whole
    conversation sent at once says."""
    greedy = {"model": MODEL, "temperature": 0, "max_output_tokens": 16}
    question, follow_up = "What is the capital of France?", "And of Italy?"
    with openai_client(first_url) as first_client, openai_client(second_url) as other:
        first = first_client.responses.create(input=question, **greedy)
        assert other.responses.retrieve(first.id).output_text == first.output_text
        second = other.responses.create(previous_response_id=first.id, input=follow_up, **greedy)
        whole = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow_up},
        ]
        stateless = other.responses.create(input=whole, store=False, **greedy)
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == stateless.usage.input_tokens
        assert second.output_text == stateless.output_text
        assert first_client.responses.retrieve(second.id).output_text == second.output_text


def _completions_answered(url: str) -> float:
    """The ``/v1/completions`` requests a server answered 2xx (batch lines included)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("trio_llm:http_requests_total{")
        and 'endpoint="/v1/completions"' in line
        and 'status="2xx"' in line
    )


def _each_batch_runs_on_one_replica(urls: list[str]) -> None:
    """A batch created on each replica at once (each wakes its own batch runner, which
    looks at every batch not over): every line of both runs once, on one replica."""
    before = [_completions_answered(url) for url in urls]
    clients = [openai_client(url) for url in urls]
    try:
        lines = [completion_lines(6, 8, prefix=f"r{i}-") for i in range(len(urls))]
        ids = parallel(
            *(
                partial(start_batch, client, batch, "/v1/completions")
                for client, batch in zip(clients, lines, strict=True)
            )
        )
        for client, batch_id in zip(clients, ids, strict=True):
            batch = wait_for_batch(client, batch_id)
            assert batch.status == "completed" and batch.request_counts.completed == 6, batch
    finally:
        for client in clients:
            client.close()
    after = [_completions_answered(url) for url in urls]
    ran = [b - a for a, b in zip(before, after, strict=True)]
    assert sum(ran) == 12, ran


def test_a_postgresql_nobody_listens_on_fails_the_start_naming_the_flag() -> None:
    # A port bound but never listened on: a connection to it is refused.
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        url = f"postgresql://trio@127.0.0.1:{bound.getsockname()[1]}/trio"
        done = serve_until_it_exits("--store-url", url)
    assert done.returncode == 1, done.stderr
    assert f"trio-llm: error: --store-url {url}: " in done.stderr
    assert "Connection refused" in done.stderr
    assert "Traceback" not in done.stderr
    assert "serving" not in done.stdout
