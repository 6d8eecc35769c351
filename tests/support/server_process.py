"""Run ``trio-llm serve`` as a real subprocess, as a user would (tests and benchmarks)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tests.support.procfs import descendants

#: A small server: 16 sequences, 256 MiB of KV cache, a 1,024-token context and 256
#: tokens per step, so that steps stay short (the supervision tests and chaos trials).
SMALL_SERVER_ARGS = [
    "--max-num-seqs",
    "16",
    "--kv-cache-memory",
    "256MiB",
    "--max-model-len",
    "1024",
    "--max-num-batched-tokens",
    "256",
]

_ADDRESS = re.compile(r"serving .* on (http://\S+)")


def serve_until_it_exits(*flags: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``trio-llm serve --port 0 FLAGS`` run to its end (flags that stop the start),
    offline; its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "trio_llm", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )


class ServerStartError(RuntimeError):
    """The server exited or did not print its address in time."""


class ServerProcess:
    """``python -m trio_llm serve --port 0 ARGS`` with the bound URL parsed from stdout.

    Args:
        args: extra command-line arguments.
        log_path: file receiving the server's stderr (and the engine's, which inherits it).
        env: extra environment variables.
    """

    def __init__(
        self, args: list[str], *, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.args = args
        self.log_path = Path(log_path)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self._log: IO[str] | None = None

    def start(self, timeout: float = 300.0) -> str:
        """Start the server and return its base URL once it accepts requests.

        Raises:
            ServerStartError: it exited first or stayed silent for ``timeout`` seconds.
        """
        self._log = self.log_path.open("w")
        command = [sys.executable, "-m", "trio_llm", "serve", "--port", "0", *self.args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=self.env
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = self.process.stdout.readline()
                if not line:
                    break
                match = _ADDRESS.search(line)
                if match:
                    self.url = match.group(1)
                    return self.url
        self.close()
        raise ServerStartError(f"server did not start; log:\n{self.log()}")

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.process is not None
        return self.process.pid

    def descendants(self) -> set[int]:
        """Living processes started by the server (the engine child and anything below)."""
        return descendants(self.pid)

    def send_signal(self, signum: int) -> None:
        """Send a signal to the server process."""
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        """Wait for exit; returns the exit status (raises subprocess.TimeoutExpired)."""
        assert self.process is not None
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the server if it is still running, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        """Everything the server wrote to stderr so far."""
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT, wait, and SIGKILL as a last resort; returns the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def close(self) -> None:
        """Kill the server if it still runs and release its pipe and log file."""
        self.kill()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            self.close()
