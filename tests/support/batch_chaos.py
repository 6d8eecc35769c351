"""Batch chaos: a fault in the middle of a batch, and the batch must still complete with
every line exactly once (`BATCH_FAULTS`, trials of `tests.support.chaos`; the end-to-end
recovery test runs the same `kill_during_batch`).

- ``sigkill-server-batch``: kill -9 of the server while lines run; a new server on the
  same store resumes the batch (the lines recorded before are not run again).
- ``sigkill-engine-batch``: kill -9 of the engine child (``--engine-restart on-failure``);
  the lines it was running are run again once the new engine serves.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from tests.support.batches import (
    completion_lines,
    exactly_once_failures,
    file_lines,
    start_batch,
    wait_for_batch,
    wait_for_progress,
)
from tests.support.checks import check_tree_gone
from tests.support.load import RESTART_WAIT
from tests.support.procfs import descendants, engine_children
from tests.support.server_process import ServerProcess

if TYPE_CHECKING:
    from tests.support.chaos import TrialResult, TrialSpec

#: The batch fault kinds (also in `tests.support.faults.FAULTS`).
BATCH_FAULTS = ("sigkill-server-batch", "sigkill-engine-batch")
#: Lines of a trial's batch and tokens each generates.
LINES = 24
TOKENS = 24


@dataclass
class BatchRun:
    """What `kill_during_batch` saw.

    Attributes:
        server: the server serving at the end (the restarted one after a server kill);
            still running: the caller stops it.
        killed_exit: the exit status of the server that was killed (None: not killed).
        batch: the Batch object at its end.
        outputs: the lines of its output file.
        errors: the lines of its error file.
        results_before_fault: lines with a result when the fault struck.
        fault_to_end: seconds from the fault to the batch's end.
        tree: every process of the first server's tree (checked gone by the caller).
    """

    server: ServerProcess
    killed_exit: int | None
    batch: Any
    outputs: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    results_before_fault: int
    fault_to_end: float
    tree: set[int] = field(default_factory=set)


def kill_during_batch(
    fault: str,
    folder: Path,
    args: list[str],
    inputs: list[dict[str, Any]],
    after: int,
    server: ServerProcess | None = None,
) -> BatchRun:
    """Start a server with a store in ``folder`` (and ``args``; or use the running
    ``server`` started so), run a batch of ``inputs``, inject ``fault``
    (`BATCH_FAULTS`) once ``after`` lines have a result, restart the server after a
    server kill, and wait for the batch to end.

    Raises:
        TimeoutError: the batch did not end in time.
    """
    from tests.e2e.conftest import openai_client

    store = ["--store-url", f"sqlite:///{folder}/store.db"]
    if fault == "sigkill-engine-batch" and "--engine-restart" not in args:
        args = [*args, "--engine-restart", "on-failure", "--engine-restart-wait", str(RESTART_WAIT)]
    if server is None:
        server = ServerProcess([*args, *store], log_path=folder / "server.log")
        server.start()
    tree = descendants(server.pid) | {server.pid}
    killed_exit = None
    try:
        with openai_client(server.url) as client:
            batch_id = start_batch(client, inputs, "/v1/completions")
            progress = wait_for_progress(client, batch_id, after).request_counts
        before = progress.completed + progress.failed
        fault_at = time.monotonic()
        if fault == "sigkill-server-batch":
            os.kill(server.pid, signal.SIGKILL)
            killed_exit = server.wait(30)
            server.close()
            server = ServerProcess([*args, *store], log_path=folder / "after-kill.log")
            server.start()
        else:
            engines = engine_children(server.pid)
            if not engines:
                raise RuntimeError(f"no engine child of the server {server.pid}")
            os.kill(min(engines), signal.SIGKILL)  # one engine's, under data parallelism
        with openai_client(server.url) as client:
            batch = wait_for_batch(client, batch_id)
            ended = time.monotonic()
            outputs = file_lines(client, batch.output_file_id)
            errors = file_lines(client, batch.error_file_id)
    except BaseException:
        server.close()
        raise
    return BatchRun(server, killed_exit, batch, outputs, errors, before, ended - fault_at, tree)


def batch_failures(run: BatchRun, inputs: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a batch that had to survive a fault: not completed, a line
    missing or twice, a line failed, counts that do not match the files."""
    failures = []
    if run.batch.status != "completed":
        failures.append(f"batch ended {run.batch.status}: {run.batch.errors}")
    failures += exactly_once_failures(inputs, run.outputs)
    if run.errors:
        failures.append(f"error file lines: {run.errors[:3]}")
    counts = run.batch.request_counts
    if (counts.total, counts.completed, counts.failed) != (len(inputs), len(run.outputs), 0):
        failures.append(f"request_counts {counts} for {len(run.outputs)} output lines")
    return failures


async def run_batch_trial(spec: TrialSpec, log_dir: Path, result: TrialResult) -> None:
    """One batch trial (`BATCH_FAULTS`): the fault after a seeded number of lines, then
    the batch must complete with every line once; the last server stops cleanly (exit 0)
    and no process of either server is left."""
    folder = log_dir / f"trial-{spec.index:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    inputs = completion_lines(LINES, TOKENS)
    after = 1 + spec.seed % (LINES // 3)
    run = await trio.to_thread.run_sync(
        kill_during_batch, spec.fault, folder, spec.server_args(), inputs, after
    )
    tree = run.tree | descendants(run.server.pid) | {run.server.pid}
    try:
        result.failures += batch_failures(run, inputs)
        result.outcomes["complete"] += len(run.outputs)
        result.recovery_seconds = run.fault_to_end
        if run.killed_exit is not None and run.killed_exit != -signal.SIGKILL:
            result.failures.append(f"the killed server exited {run.killed_exit}")
        run.server.send_signal(signal.SIGTERM)
        result.exit_code = await trio.to_thread.run_sync(run.server.wait, 30)
        if result.exit_code != 0:
            result.failures.append(f"exit status {result.exit_code} after SIGTERM, expected 0")
    finally:
        run.server.close()
        await check_tree_gone(tree, result)
        if not result.ok:
            result.failures.append(f"logs: {folder}")
