"""A real server with the real model, shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_llm.testing.server_process import ServerProcess

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Iterator[ServerProcess]:
    """``trio-llm serve`` with the default model, fp32 (started once per test session)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = ServerProcess(["--max-num-seqs", "32", "--dtype", "float32"], log_path=log)
    with process:
        yield process
    assert process.process is not None
    assert process.process.returncode == 0, process.log()


@pytest.fixture
def base_url(server: ServerProcess) -> str:
    return server.url
