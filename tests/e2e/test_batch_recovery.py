"""Nothing is lost: kill -9 of the server in the middle of a batch, then a new server on
the same store, which completes the batch with every line exactly once; then kill -9 of
the engine child (``--engine-restart on-failure``) in the middle of another. The results
equal the online answers (greedy, float32, one torch thread: the same bits before and
after the restarts)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import parallel
from tests.support.batch_chaos import batch_failures, kill_during_batch
from tests.support.batches import completion_lines, normalized, online
from tests.support.checks import become_subreaper
from tests.support.procfs import process_state
from tests.support.server_process import SMALL_SERVER_ARGS

ARGS = [
    *SMALL_SERVER_ARGS,
    "--dtype",
    "float32",
    "--num-threads",
    "1",
    "--engine-restart",
    "on-failure",
    "--batch-max-lines-in-flight",
    "4",
]


@pytest.fixture(scope="module", autouse=True)
def subreaper() -> None:
    """The engine child of the killed server is adopted (and reaped) by pytest."""
    become_subreaper()


def check_online(url: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> None:
    answers = parallel(
        *(lambda item=item: online(url, item["url"], item["body"]) for item in inputs)
    )
    for (status, body), result in zip(answers, outputs, strict=True):
        assert status == result["response"]["status_code"] == 200
        assert normalized(result["response"]["body"]) == normalized(body), result["custom_id"]


def test_batches_survive_a_killed_server_and_a_killed_engine(tmp_path: Path) -> None:
    first = completion_lines(8, 16, prefix="before-")
    run = kill_during_batch("sigkill-server-batch", tmp_path, ARGS, first, after=2)
    server = run.server
    try:
        assert run.killed_exit == -signal.SIGKILL
        assert 2 <= run.results_before_fault < len(first)  # killed in the middle
        assert batch_failures(run, first) == []
        assert all(process_state(pid) in (None, "Z") for pid in run.tree)

        second = completion_lines(8, 16, prefix="engine-")
        engine_run = kill_during_batch(
            "sigkill-engine-batch", tmp_path, ARGS, second, after=2, server=server
        )
        assert engine_run.results_before_fault < len(second)
        assert batch_failures(engine_run, second) == []
        assert "failed: " in server.log() and "restarting it in" in server.log()

        check_online(server.url, first, run.outputs)
        check_online(server.url, second, engine_run.outputs)
        assert server.stop() == 0
    finally:
        server.close()
