"""A child process started from the Trio thread itself, awaited without threads.

`trio.lowlevel.open_process` forks from a worker thread. That breaks
``prctl(PR_SET_PDEATHSIG)``: the kernel sends the signal when the *thread* that forked
the child exits, and Trio retires idle worker threads after a few seconds, which would
kill a healthy child. So the child is spawned with `subprocess.Popen` directly in the
Trio thread (a vfork+exec, milliseconds) and its exit is awaited through a pidfd
(Linux >= 5.3), or through a worker thread where pidfds are unavailable.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

import trio


class ChildProcess:
    """A running child; `wait` is async and cancellable, `terminate`/`kill` are safe to repeat.

    Args:
        command: argv of the child.
        pass_fds: file descriptors the child inherits.
    """

    def __init__(self, command: Sequence[str], *, pass_fds: Sequence[int] = ()) -> None:
        self._popen = subprocess.Popen(
            list(command), pass_fds=tuple(pass_fds), stdin=subprocess.DEVNULL
        )
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self._popen.pid)
            except OSError:
                self._pidfd = None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None while running; the exit status, or ``-signal`` if killed by a signal."""
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait until the child exits and reap it; returns `returncode`."""
        if self._popen.returncode is None:
            if self._pidfd is not None:
                await trio.lowlevel.wait_readable(self._pidfd)
                self._popen.wait()
            else:
                await trio.to_thread.run_sync(self._popen.wait, abandon_on_cancel=True)
        self._close_pidfd()
        returncode = self._popen.returncode
        if returncode is None:
            raise RuntimeError(f"child {self._popen.pid} was reaped without an exit status")
        return returncode

    def terminate(self) -> None:
        """Send SIGTERM (and SIGCONT, so a stopped child acts on it) unless already reaped."""
        if self._popen.poll() is None:
            self._popen.terminate()
            self._popen.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Send SIGKILL unless the child was already reaped."""
        if self._popen.poll() is None:
            self._popen.kill()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
