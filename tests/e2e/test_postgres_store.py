"""``trio-llm serve --store-url postgresql://...``: two servers started at once on one
new PostgreSQL database (replicas behind a router) both start, the schema is migrated
once, both serve and both stop with exit 0; a PostgreSQL nobody listens on fails the
start-up with a message that names ``--store-url``, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL, openai_client, parallel
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess
from trio_llm.store.migrations import SCHEMA_VERSION

psycopg = pytest.importorskip("psycopg")

#: Two servers share the machine: one compute thread each.
ARGS = [*SMALL_SERVER_ARGS, "--dtype", "float32", "--num-threads", "1"]


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
        assert [server.stop() for server in servers] == [0, 0]
    finally:
        for server in servers:
            server.close()
    migrated = [server.log().count(f"schema version 0 -> {SCHEMA_VERSION}") for server in servers]
    assert sorted(migrated) == [0, 1], [server.log() for server in servers]


def test_a_postgresql_nobody_listens_on_fails_the_start_naming_the_flag() -> None:
    # A port bound but never listened on: a connection to it is refused.
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        url = f"postgresql://trio@127.0.0.1:{bound.getsockname()[1]}/trio"
        done = subprocess.run(
            [sys.executable, "-m", "trio_llm", "serve", "--port", "0", "--store-url", url],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=False,
        )
    assert done.returncode == 1, done.stderr
    assert f"trio-llm: error: --store-url {url}: " in done.stderr
    assert "Connection refused" in done.stderr
    assert "Traceback" not in done.stderr
    assert "serving" not in done.stdout
