"""What a chaos trial checks afterwards: every request ended as its fault allows, in time;
the surviving server's file descriptors came back; no process of the tree is left running
or unreaped; the port is free."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from collections import Counter
from typing import TYPE_CHECKING

import trio

from tests.support.load import Record
from tests.support.procfs import (
    count_fds,
    fd_targets,
    open_fds,
    parent_pid,
    pidfd_target,
    process_state,
    socket_inode,
    tcp_sockets,
    wait_for_exit,
)

if TYPE_CHECKING:
    from tests.support.chaos import TrialResult, TrialSpec


def check_records(
    spec: TrialSpec,
    records: list[Record],
    open_at_fault: list[Record],
    fault_time: float,
    deadline: float,
    result: TrialResult,
) -> None:
    disrupted = spec.server_stops or spec.engine_fails
    for record in records:
        result.outcomes[record.outcome] += 1
        if record.outcome == "hung":
            result.hung += 1
            result.failures.append(f"{record.kind} request never ended: {record.detail}")
            continue
        after_fault = record.end >= fault_time
        if record.outcome == "cut" and spec.fault != "sigkill-server":
            result.lost += 1
            result.failures.append(f"{record.kind} request cut without an end: {record.detail}")
        elif record.outcome in ("refused", "no-response") and not (
            spec.server_stops and after_fault
        ):
            result.lost += 1
            result.failures.append(f"{record.kind} request {record.outcome}: {record.detail}")
        elif record.outcome == "error" and not after_fault:
            result.failures.append(
                f"{record.kind} request failed before the fault: {record.detail}"
            )
        elif (
            record.outcome == "error"
            and not disrupted
            and spec.fault != "burst"
            and not (spec.two_models and record.kind == "embed")  # the killed model's
        ):
            result.failures.append(
                f"{record.kind} request failed after a harmless fault: {record.detail}"
            )
    if disrupted:
        late = [
            r
            for r in open_at_fault
            if r.end - fault_time > deadline + _stop_allowance(spec)
            and not (spec.restart and _waited_for_restart(r))
        ]
        for record in late:
            result.failures.append(
                f"{record.kind} request ended {record.end - fault_time:.1f} s after the fault"
            )
    if spec.engine_fails and spec.data_parallel_size > 1:
        # The other engine serves on: requests it held at the fault complete.
        if not any(r.outcome == "complete" for r in open_at_fault):
            result.failures.append(
                "no request open at the fault completed: the engines did not fail alone"
            )
    if spec.fault == "burst":
        refused = [r for r in records if r.kind == "burst" and r.outcome == "error"]
        if not all("503" in r.detail for r in refused):
            result.failures.append("a burst request failed with something other than 503")


def _waited_for_restart(record: Record) -> bool:
    """A request the server had not yet handed to the engine when it failed waits for
    the restarted one: it then completes, or gets 503 ``engine_restarting``."""
    return record.outcome in ("complete", "left") or "restarting" in record.detail


def _stop_allowance(spec: TrialSpec) -> float:
    return spec.stop_seconds if spec.fault == "sigstop-engine" else 0.0


#: hypercorn closes a connection the client already closed (CLOSE_WAIT) only when its
#: keep-alive timeout (5 s) expires, so descriptors may take that long to come back; a
#: leak never comes back.
FD_SETTLE_SECONDS = 12.0


def client_connections(pid: int) -> list[str]:
    """The TCP connections ``pid`` holds (every TCP socket of its descriptors but the
    listening ones), as ``"fd N: STATE"``."""
    states = {"01": "established", "08": "close-wait", "06": "time-wait"}
    tcp = tcp_sockets(pid)
    found = []
    for fd, target in sorted(open_fds(pid).items()):
        inode = socket_inode(target)
        if inode in tcp and tcp[inode][0] != "0A":
            found.append(f"fd {fd}: {states.get(tcp[inode][0], tcp[inode][0])}")
    return found


async def settled_fds(pid: int) -> dict[int, str]:
    """``pid``'s descriptors (`open_fds`) once it holds no client connection, or after
    `FD_SETTLE_SECONDS`: the count a trial's server must come back to.

    A probe's connection (a request just before the snapshot) stays open in the server
    until hypercorn's keep-alive timeout closes it; counted in the snapshot, it is missing
    from the later count, which then looks like one descriptor too few."""
    with trio.move_on_after(FD_SETTLE_SECONDS):
        # Another process's descriptors: they close as its handlers finish.
        while client_connections(pid):  # noqa: ASYNC110
            await trio.sleep(0.1)
    return open_fds(pid)


async def check_fds(
    pid: int,
    before: dict[int, str],
    result: TrialResult,
    *,
    held: int = 0,
    engine_lost: bool = False,
) -> None:
    """The surviving server's descriptors come back to what they were before the load
    (``before``: number -> target, `open_fds`), plus ``held`` a client still holds open.

    With ``engine_lost`` (one of several engines failed for good) the server must have
    closed that engine's handles: it settles on fewer descriptors than before, each one
    of them open before the load, and none a pidfd of an exited process."""
    expected = len(before) + held
    settled = False
    with trio.move_on_after(FD_SETTLE_SECONDS):
        # Another process's descriptors: they close as its handlers finish.
        while not (settled := _fds_settled(pid, before, expected, engine_lost)):  # noqa: ASYNC110
            await trio.sleep(0.1)
    if not settled:
        now = count_fds(pid)
        if engine_lost:
            wanted = f"fewer than {len(before)}, all of them open before the load"
        else:
            wanted = f"{expected}"
        result.failures.append(
            f"server holds {now} file descriptors, {wanted} expected: {describe_fds(pid)}"
        )


def _fds_settled(pid: int, before: dict[int, str], expected: int, engine_lost: bool) -> bool:
    now = open_fds(pid)
    if not engine_lost:
        return len(now) == expected
    return (
        len(now) < len(before)
        and all(before.get(fd) == target for fd, target in now.items())
        and all(pidfd_target(pid, fd) != -1 for fd in now)
    )


async def check_tree_gone(tree: set[int], result: TrialResult) -> None:
    """Every process the trial saw has exited and was reaped (by its parent, or by us
    once adopted after its parent died)."""
    with trio.move_on_after(5):
        for pid in tree:
            await wait_for_exit(pid)
            if parent_pid(pid) == os.getpid():
                await trio.to_thread.run_sync(_reap, pid, abandon_on_cancel=True)
        # A parent that is still alive reaps its exited children by itself.
        while any(process_state(pid) is not None for pid in tree):  # noqa: ASYNC110
            await trio.sleep(0.05)
    for pid in tree:
        state = process_state(pid)
        if state is not None and state != "Z":
            result.orphans += 1
            result.failures.append(f"process {pid} still running (state {state})")
        elif state == "Z":
            result.orphans += 1
            result.failures.append(f"process {pid} left unreaped (parent {parent_pid(pid)})")


def describe_fds(pid: int) -> str:
    """What ``pid``'s descriptors are, counted by kind (TCP sockets by state)."""
    states = {"01": "established", "08": "close-wait", "0A": "listen", "06": "time-wait"}
    tcp = {inode: states.get(state, state) for inode, (state, _) in tcp_sockets(pid).items()}
    kinds: Counter[str] = Counter()
    targets = fd_targets(pid)
    if targets is None:
        return "gone"
    for target in targets:
        if (inode := socket_inode(target)) is not None:
            kinds[f"tcp {tcp[inode]}" if inode in tcp else "socket"] += 1
        else:
            kinds[target.split(":")[0] if ":" in target else target] += 1
    return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): children of a
    SIGKILLed server become ours, and a trial reaps them after checking they exited."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
