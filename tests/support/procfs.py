"""Process inspection through /proc (Linux), for tests that prove nothing is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import trio


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces.
    return text[text.rindex(")") + 2 :].split()


def is_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None if it is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def descendants(pid: int) -> set[int]:
    """Every living process whose ancestry leads to ``pid`` (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = parent_pid(int(entry))
            if ppid is not None and is_running(int(entry)):
                children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def command_line(pid: int) -> str:
    """The process's argv joined by spaces ('' if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def engine_children(pid: int | None = None) -> set[int]:
    """Living engine-core processes descended from ``pid`` (default: this process)."""
    return module_children("trio_llm.engine", pid)


def detokenizer_children(pid: int | None = None) -> set[int]:
    """Living detokenizer processes (3-process mode) descended from ``pid``."""
    return module_children("trio_llm.detokenizer", pid)


def server_children(pid: int | None = None) -> set[int]:
    """Every living engine-core or detokenizer process descended from ``pid``."""
    return engine_children(pid) | detokenizer_children(pid)


def module_children(module: str, pid: int | None = None) -> set[int]:
    """Living processes descended from ``pid`` (default: this one) that run ``-m module``."""
    root = os.getpid() if pid is None else pid
    return {p for p in descendants(root) if f"-m {module} " in command_line(p) + " "}


async def wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` (any process, not only a child) has exited.

    Uses a pidfd, which becomes readable when the process terminates (Linux >= 5.3).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if is_running(pid):
            await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z``, ...), None if gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields is not None else None


def count_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (raises OSError if it is gone or not ours)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str] | None:
    """What each of ``pid``'s open descriptors points to (a path, ``socket:[INODE]``,
    ``pipe:[INODE]``, ...); None if the process is gone."""
    fds = _read_fds(pid)
    return None if fds is None else list(fds.values())


def open_fds(pid: int) -> dict[int, str]:
    """``pid``'s open descriptors: number -> target (see `fd_targets`); empty if it is gone."""
    return _read_fds(pid) or {}


def _read_fds(pid: int) -> dict[int, str] | None:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    fds = {}
    for name in names:
        try:
            fds[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
    return fds


def pidfd_target(pid: int, fd: int) -> int | None:
    """The process a pidfd of ``pid`` refers to (-1 once that process has exited and was
    reaped); None if ``fd`` is not a pidfd or is closed."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def socket_inode(target: str) -> str | None:
    """The inode of a descriptor target that is a socket (``socket:[INODE]``)."""
    return target[len("socket:[") : -1] if target.startswith("socket:[") else None


def _socket_inodes(pid: int) -> set[str]:
    inodes = (socket_inode(target) for target in fd_targets(pid) or [])
    return {inode for inode in inodes if inode is not None}


def tcp_sockets(pid: int) -> dict[str, tuple[str, int]]:
    """TCP sockets of ``pid``'s network namespace: inode -> (state, local port).

    The state is the kernel's hex code from /proc/net/tcp and tcp6 (``01`` established,
    ``08`` close-wait, ``0A`` listen, ...).
    """
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            found[fields[9]] = (fields[3], int(fields[1].rsplit(":", 1)[1], 16))
    return found


def listening_sockets(pid: int) -> list[str]:
    """Listening sockets held by ``pid``: ``"tcp:PORT"`` and ``"unix:PATH"`` entries.

    Read from /proc/net/tcp, tcp6 (state 0A, LISTEN) and unix (flag __SO_ACCEPTCON),
    matched to the process's file descriptors by inode.
    """
    inodes = _socket_inodes(pid)
    found = [
        f"tcp:{port}"
        for inode, (state, port) in tcp_sockets(pid).items()
        if state == "0A" and inode in inodes
    ]
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if int(fields[3], 16) & 0x10000 and fields[6] in inodes:
            found.append(f"unix:{fields[7] if len(fields) > 7 else '(unnamed)'}")
    return sorted(found)
