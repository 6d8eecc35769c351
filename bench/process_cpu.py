"""Where the CPU time of a server run goes: per-process CPU seconds and py-spy profiles.

`CpuMeter` reads utime + stime from /proc/PID/stat (Linux) of the server and each of its
children (engine core, detokenizer) before and after a run; it costs nothing during the
run. `Profiler` attaches ``py-spy record`` (sampling, ``--nonblocking``) to each process
for a separate, perturbed pass and `top_frames` summarises its raw output by the leaf
function that was running (self time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import common  # noqa: F401  (puts the repository root on sys.path, for tests.support)

from tests.support.procfs import command_line, descendants

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

#: py-spy from the same virtual environment as this interpreter, else from the PATH (the
#: GPU run installs it with --target, bench/device_run.sh).
PY_SPY = str(Path(sys.executable).parent / "py-spy")
if not Path(PY_SPY).exists():
    PY_SPY = shutil.which("py-spy") or PY_SPY


def role(pid: int, server_pid: int) -> str:
    """ "api server", "engine core" or "detokenizer" for a process of the server's tree."""
    if pid == server_pid:
        return "api server"
    line = command_line(pid)
    if "trio_llm.detokenizer" in line:
        return "detokenizer"
    if "trio_llm.engine" in line:
        return "engine core"
    return line.split(" ")[0] or str(pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (all its threads)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class CpuMeter:
    """CPU seconds used by each process of a server's tree between `start` and `stop`."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.pids = [server_pid, *sorted(descendants(server_pid))]
        self._before: dict[int, float] = {}
        self.used: dict[str, float] = {}

    def start(self) -> None:
        self._before = {pid: cpu_seconds(pid) for pid in self.pids}

    def stop(self) -> dict[str, float]:
        """CPU seconds per role since `start`."""
        self.used = {
            role(pid, self.server_pid): cpu_seconds(pid) - self._before[pid] for pid in self.pids
        }
        return self.used


class Profiler:
    """``py-spy record`` attached to every process of a server's tree, one file each.

    Args:
        out_dir: where ``<role>.txt`` (py-spy's raw collapsed stacks) are written.
        rate: samples per second.
    """

    def __init__(self, server_pid: int, out_dir: Path, rate: int = 50) -> None:
        self.server_pid = server_pid
        self.out_dir = out_dir
        self.rate = rate
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for pid in [self.server_pid, *sorted(descendants(self.server_pid))]:
            name = role(pid, self.server_pid)
            path = self.out_dir / f"{name.replace(' ', '_')}.txt"
            command = [PY_SPY, "record", "--nonblocking", "-r", str(self.rate), "-f", "raw"]
            command += ["-o", str(path), "-p", str(pid)]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._procs.append((name, proc))

    def stop(self) -> dict[str, Path]:
        """Stop sampling (SIGINT makes py-spy write its file); the file of each role."""
        files = {}
        for name, proc in self._procs:
            proc.send_signal(2)
            proc.wait(timeout=60)
            files[name] = self.out_dir / f"{name.replace(' ', '_')}.txt"
        return files


def top_frames(path: Path, count: int = 8) -> list[tuple[str, float]]:
    """The ``count`` leaf functions with the most samples in a py-spy raw file, with their
    share of all samples (0..1)."""
    leaves: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        leaves[leaf] += int(samples)
        total += int(samples)
    return [(frame, n / total) for frame, n in leaves.most_common(count)] if total else []
