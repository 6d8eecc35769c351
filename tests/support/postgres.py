"""A real PostgreSQL server for the tests of the store's PostgreSQL side.

`PostgresServer.start` runs ``initdb`` into a fresh folder under /tmp and then the
``postgres`` server itself, as a child of this process, listening on a Unix socket in
that folder only (no TCP port to collide on). PostgreSQL refuses to run as root: as root
it runs as the ``postgres`` system user that Debian's package creates, the folder handed
to it. Durability is off (``fsync``, ``synchronous_commit``, ``full_page_writes``): a
test server loses nothing it needs to keep. Each test gets a database of its own
(`create_database`, dropped by `drop_database`).

`unavailable_reason` says why none can run here (no server programs, root without a
``postgres`` user, no psycopg): the tests that need one skip with that reason.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from tests.support.procfs import descendants, is_running

#: The programs a server needs, in the ``bin`` folder of one PostgreSQL version.
PROGRAMS = ("initdb", "postgres")

#: Where Debian and Ubuntu install each version's programs (``/usr/lib/postgresql/15/bin``).
DEBIAN_BIN_DIRS = "/usr/lib/postgresql/*/bin"

#: The system user the server runs as when the tests run as root.
SERVER_USER = "postgres"

#: Seconds the server may take to initialise, start or stop.
TIMEOUT = 60.0

#: The superuser of the test cluster (no password: its socket is reachable by this user).
SUPERUSER = "postgres"

#: Server settings: a Unix socket only, no durability, room for every test's connections.
SETTINGS = {
    "listen_addresses": "",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
}

PR_SET_PDEATHSIG = 1


def find_bin_dir() -> Path | None:
    """The ``bin`` folder of the newest PostgreSQL found (Debian's layout first, then
    ``initdb`` on the PATH); None when there is none."""

    def version(folder: Path) -> tuple[int, ...]:
        name = folder.parent.name
        return tuple(int(part) for part in name.split(".") if part.isdigit())

    candidates = sorted(Path("/").glob(DEBIAN_BIN_DIRS.lstrip("/")), key=version, reverse=True)
    on_path = shutil.which("initdb")
    if on_path is not None:
        candidates.append(Path(on_path).parent)
    for folder in candidates:
        if all(os.access(folder / program, os.X_OK) for program in PROGRAMS):
            return folder
    return None


def unavailable_reason() -> str | None:
    """Why no PostgreSQL server can run for the tests here; None when one can."""
    if find_bin_dir() is None:
        return (
            "PostgreSQL's server programs (initdb, postgres) are not installed: "
            "apt-get install postgresql (`make postgres` does it as root)"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return (
                f"running as root, and there is no {SERVER_USER!r} user to run PostgreSQL as "
                "(it refuses root)"
            )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install 'trio_llm[postgres]'"
    return None


class PostgresStartError(RuntimeError):
    """``initdb`` or the server failed; the message holds what it printed."""


class PostgresServer:
    """One PostgreSQL server in a folder of its own, run by this process.

    Attributes:
        folder: the cluster (``data``), the socket and the server's log live here.
        bin_dir: the folder of ``initdb`` and ``postgres``.
    """

    def __init__(self, folder: Path, bin_dir: Path) -> None:
        self.folder = folder
        self.bin_dir = bin_dir
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._names = itertools.count()
        self._user: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            self._user = pwd.getpwnam(SERVER_USER)
            os.chown(folder, self._user.pw_uid, self._user.pw_gid)

    @classmethod
    def start(cls) -> PostgresServer:
        """Initialise a cluster in a new folder and start its server; return once it
        accepts connections.

        Raises:
            PostgresStartError: ``initdb`` failed, or the server exited or did not
                become ready in `TIMEOUT` seconds (the folder is removed).
        """
        bin_dir = find_bin_dir()
        assert bin_dir is not None, unavailable_reason()
        # Under /tmp: the socket's path must stay short (about 100 bytes at most), and
        # the server's user must reach it (pytest's own temp folder is private to us).
        server = cls(Path(tempfile.mkdtemp(prefix="trio-llm-pg-", dir="/tmp")), bin_dir)
        try:
            server._initdb()
            server._run()
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def log_path(self) -> Path:
        """The server's log (its stderr)."""
        return self.folder / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        """The ``postgresql://`` URL of ``database`` on this server (over its socket)."""
        return f"postgresql://{SUPERUSER}@/{database}?host={self.folder}"

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        name = f"trio_test_{next(self._names)}"
        self._admin(f"CREATE DATABASE {name} STRATEGY FILE_COPY")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url`` (closing whatever connections to it are left)."""
        name = url.split("?", 1)[0].rsplit("/", 1)[1]
        self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    @contextmanager
    def database(self) -> Iterator[str]:
        """A new, empty database for the block (`create_database`), dropped after it."""
        url = self.create_database()
        try:
            yield url
        finally:
            self.drop_database(url)

    def pids(self) -> set[int]:
        """The living server processes: the postmaster and every process under it."""
        if self.process is None or self.process.poll() is not None:
            return set()
        return {self.process.pid} | descendants(self.process.pid)

    def stop(self) -> None:
        """Stop the server (PostgreSQL's fast shutdown: SIGINT) and remove its folder;
        SIGKILL after `TIMEOUT` seconds. Idempotent."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def log(self) -> str:
        """What the server wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(sql)

    def _as_server_user(self) -> dict[str, Any]:
        """`subprocess` arguments that run a program as the server's user."""
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def _initdb(self) -> None:
        command = [str(self.bin_dir / "initdb"), "-D", str(self.folder / "data")]
        command += ["-U", SUPERUSER, "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"]
        done = subprocess.run(
            command,
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=_server_env(),
            check=False,
            **self._as_server_user(),
        )
        if done.returncode != 0:
            raise PostgresStartError(f"initdb failed:\n{done.stdout}{done.stderr}")

    def _run(self) -> None:
        command = [str(self.bin_dir / "postgres"), "-D", str(self.folder / "data")]
        command += ["-k", str(self.folder)]
        for name, value in SETTINGS.items():
            command += ["-c", f"{name}={value}"]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            cwd=self.folder,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=_server_env(),
            preexec_fn=_stop_with_parent,
            **self._as_server_user(),
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Poll the server's pid file until it says ``ready`` (as ``pg_ctl -w`` does)."""
        assert self.process is not None
        pid_file = self.folder / "data" / "postmaster.pid"
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PostgresStartError(
                    f"postgres exited ({self.process.returncode}):\n{self.log()}"
                )
            try:
                lines = pid_file.read_text().splitlines()
            except (FileNotFoundError, PermissionError):
                lines = []
            if len(lines) >= 8 and lines[7].strip() == "ready":
                return
            time.sleep(0.02)  # polling with a deadline: the server writes no other signal
        raise PostgresStartError(f"postgres was not ready in {TIMEOUT:.0f} s:\n{self.log()}")


def _server_env() -> dict[str, str]:
    """The server's environment: this one's, less anything that would point libpq or the
    server elsewhere."""
    return {name: value for name, value in os.environ.items() if not name.startswith("PG")}


#: libc's ``prctl``, looked up before any fork (Linux only).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _stop_with_parent() -> None:
    """In the server's process before exec (after its user is set, which would clear
    it): the kernel sends it SIGQUIT, PostgreSQL's immediate shutdown, when the thread
    that started it ends, so no server outlives the tests."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGQUIT, 0, 0, 0)


def is_gone(pids: set[int]) -> bool:
    """True when none of ``pids`` is a living process."""
    return not any(is_running(pid) for pid in pids)
