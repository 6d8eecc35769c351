"""test_stored_responses' tests of the Responses API's stored side, run again with the
server's store on PostgreSQL (replicas behind a router share one): a continuation and
a restart (the store-level tests run every unit of work on PostgreSQL too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_stored_responses import (  # noqa: F401 (fixtures and tests run here too)
    client,
    first_server,
    test_a_continuation_says_what_the_whole_conversation_says,
    test_stored_responses_survive_a_restart,
)
from tests.support.postgres import PostgresServer

pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def store_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh PostgreSQL database for the module's servers (the restart uses it again)."""
    with postgres_server.database() as url:
        yield url
