"""Which server runs what: the store's runners (units of work on ``store_runners``).

Background responses and batches are run by one server at a time, the one whose id is in
their ``runner`` column. Each server that opens the store is a `Runner`: it registers at
start-up, writes a heartbeat every `HEARTBEAT_SECONDS`, and forgets itself when it closes
the store. Another server takes over (a compare-and-set of ``runner``) only the work of a
runner that is gone (`live`): no heartbeat for `STALE_SECONDS`, or, on the same machine
and in the same process namespace, a process that no longer runs (so a server restarted
after ``kill -9`` takes its predecessor's work at once). Replicas behind a router on one
PostgreSQL store therefore run each batch and background response once.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from trio_llm.store.database import Transaction

#: Seconds between two heartbeats of a running server.
HEARTBEAT_SECONDS = 5.0
#: Seconds without a heartbeat after which a runner counts as gone.
STALE_SECONDS = 30
#: Seconds after which a gone runner's row is removed.
FORGET_AFTER_SECONDS = 86400


@dataclass(frozen=True)
class Runner:
    """One server (or ``trio-llm run-batch``) using the store.

    Attributes:
        id: random, new at each start.
        machine: this machine's boot id and process namespace ("" where unknown): two
            runners with the same one can check each other's process.
        pid: the process id.
    """

    id: str
    machine: str
    pid: int


def this_runner() -> Runner:
    """A new `Runner` for this process."""
    return Runner(uuid.uuid4().hex, _machine(), os.getpid())


def _machine() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"


def process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this process namespace runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def register(tx: Transaction, runner: Runner, at: float | None = None) -> None:
    """Record ``runner`` as running now."""
    now = int(time.time() if at is None else at)
    tx.execute("DELETE FROM store_runners WHERE id = ?", (runner.id,))
    tx.execute(
        "INSERT INTO store_runners (id, machine, pid, seen_at) VALUES (?, ?, ?, ?)",
        (runner.id, runner.machine, runner.pid, now),
    )


def beat(tx: Transaction, runner: Runner, at: float | None = None) -> None:
    """``runner``'s heartbeat (registering it again if its row was removed); rows of
    runners gone for `FORGET_AFTER_SECONDS` go."""
    now = int(time.time() if at is None else at)
    if tx.execute("UPDATE store_runners SET seen_at = ? WHERE id = ?", (now, runner.id)) == 0:
        register(tx, runner, now)
    tx.execute("DELETE FROM store_runners WHERE seen_at < ?", (now - FORGET_AFTER_SECONDS,))


def forget(tx: Transaction, runner: Runner) -> None:
    """Remove ``runner`` (a server that stops): its work may be taken over at once."""
    tx.execute("DELETE FROM store_runners WHERE id = ?", (runner.id,))


def live(tx: Transaction, me: Runner, at: float | None = None) -> set[str]:
    """The ids of the runners that still run, ``me`` included."""
    now = int(time.time() if at is None else at)
    alive = {me.id}
    for runner_id, machine, pid, seen_at in tx.rows(
        "SELECT id, machine, pid, seen_at FROM store_runners"
    ):
        if seen_at < now - STALE_SECONDS:
            continue
        if machine and machine == me.machine and pid != me.pid and not process_runs(pid):
            continue
        alive.add(str(runner_id))
    return alive


def runner_is(runner: str | None) -> tuple[str, tuple[str, ...]]:
    """A SQL condition (and its parameters) that the ``runner`` column is ``runner``
    (None: no runner)."""
    return ("runner IS NULL", ()) if runner is None else ("runner = ?", (runner,))
