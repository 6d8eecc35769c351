"""Shared fixtures (the tiny random model, the real SmolLM2 folder) and the test tiers.

Two tiers: tests that spawn no process and run no model (fast) and tests marked ``slow``
that start engines (in this process or another), servers or any other subprocess.
``pytest -m "not slow"`` runs the fast tier alone; plain ``pytest`` runs both, the fast
tier first. Every test under
`SLOW_DIRS` is slow (each starts a real server); elsewhere a module or test says so with
``pytestmark = pytest.mark.slow`` or ``@pytest.mark.slow``. A test of the store on
PostgreSQL (``store_url[postgresql]``, or one that asks for `postgres_server`) is slow too:
it needs the PostgreSQL server the session starts once.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# No test reads another test's (or an earlier run's) prompt blocks from disk: the prefix
# cache's tier on disk is off unless a test names its own folder (--prefix-cache-dir).
os.environ.setdefault("TRIO_LLM_PREFIX_CACHE_DIR", "none")

from tests.support.postgres import PostgresServer, is_gone, unavailable_reason
from tests.support.tiny_model import save_tiny_model
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir

#: Folders of tests/ whose every test starts a server (end-to-end, chaos, fuzzing).
SLOW_DIRS = ("e2e", "chaos", "fuzz")

TESTS = Path(__file__).parent
#: Set to run the tests marked ``long`` (``make test-long``): each starts several servers
#: or restarts engines and servers again and again (replicas, chaos samples, restarts).
LONG_ENV = "TRIO_LLM_LONG"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Generator[None, None, None]:
    """Mark everything under `SLOW_DIRS` slow (before ``-m`` selects), skip the ``long``
    tests unless `LONG_ENV` is set, then run the fast tier first (after pytest's own
    reordering; the order within each tier is kept)."""
    run_long = bool(os.environ.get(LONG_ENV))
    for item in items:
        if item.get_closest_marker("long") is not None and not run_long:
            item.add_marker(pytest.mark.skip(reason=f"opt-in long test: set {LONG_ENV}=1"))
        relative = item.path.relative_to(TESTS) if item.path.is_relative_to(TESTS) else None
        if relative is not None and relative.parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
        elif "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    yield
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is not None)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from GGUF once, cached)."""
    return resolve_model_dir(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (vocabulary 49,152), saved to disk."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-model"), tokenizer_dir=real_model_dir, vocab_size=49152
    )


@pytest.fixture(scope="session")
def smol_tokenizer(real_model_dir: Path):
    """The SmolLM2 tokenizer (byte-level BPE with a ChatML template)."""
    from trio_llm.text.tokenizer import Tokenizer

    return Tokenizer.load(real_model_dir)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session (started on first use; skips the test,
    with the reason, where none can run: `tests.support.postgres.unavailable_reason`).
    Stopped at the end of the session, every one of its processes gone."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no PostgreSQL server for the store tests: {reason}")
    server = PostgresServer.start()
    try:
        yield server
    finally:
        pids = server.pids()
        server.stop()
    assert pids and is_gone(pids), f"PostgreSQL processes left after the stop: {pids}"


@pytest.fixture
def sqlite_store_url(tmp_path: Path) -> str:
    """The ``--store-url`` of a fresh, empty SQLite store (a file under ``tmp_path``)."""
    return f"sqlite:///{tmp_path / 'store' / 'store.db'}"


@pytest.fixture
def postgres_store_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The ``--store-url`` of a fresh, empty PostgreSQL database, dropped after the test."""
    with postgres_server.database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def store_url(request: pytest.FixtureRequest) -> str:
    """The ``--store-url`` of a fresh, empty store for one test: every test that uses it
    runs on SQLite (`sqlite_store_url`) and on PostgreSQL (`postgres_store_url`, slow)."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_store_url")
    return request.getfixturevalue("postgres_store_url")


@pytest.fixture
def store(store_url: str, tmp_path: Path):
    """A fresh `trio_llm.store.Store` at `store_url`, closed after the test."""
    from trio_llm.store import open_store

    opened = open_store(store_url, tmp_path)
    yield opened
    opened.close()
