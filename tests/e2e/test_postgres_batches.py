"""test_batches_api's tests of files and batches, run again with the server's store on
PostgreSQL: results equal to the online answers, with an error file (the store-level
tests run every unit of work on PostgreSQL too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_batches_api import (  # noqa: F401 (fixtures and tests run here too)
    batch_server,
    client,
    test_batch_results_equal_the_online_answers_and_bad_lines_go_to_the_error_file,
)
from tests.support.postgres import PostgresServer

pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def batch_store_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh PostgreSQL database for the module's server."""
    with postgres_server.database() as url:
        yield url
