"""Soak: N concurrent streaming clients against one server, with memory and fd checks.

    python bench/soak.py                                # 1,000 clients, its own server
    python bench/soak.py --clients 50 --time-limit 120  # a quick check
    python bench/soak.py --server-args='--detokenizer-mode process' --json out.json
    python bench/soak.py --url http://127.0.0.1:8000 [--server-pid PID]
    python bench/soak.py --rounds 3 --clients 300   # does memory settle or keep growing?

Starts ``trio-llm serve`` on a free port (``--max-num-seqs 256`` by default, more flags
with ``--server-args``), or uses the server at ``--url``. Then opens ``--clients``
streaming requests at the same instant (or spread over ``--ramp`` seconds), each on its
own connection from 127.0.0.1: ``/v1/completions``, and ``/v1/chat/completions`` for a
``--chat-share`` of them, a prompt of ``--prompt-lines`` consecutive lines of
bench/data/sonnet.txt, exactly ``--max-tokens`` output tokens (``ignore_eos``).

What it measures:

- per client: time to its first content token from sending the request (TTFT), to the
  TCP connection (as the client sees it: the server's SYN-ACK, which the kernel sends
  before the server accepts), to the response headers, and how it ended. *Completed*:
  ``data: [DONE]`` after at least one token and no error event. *Errors*, by kind: an
  HTTP status other than 200, an error event, a transport error (by exception class), a
  stream without ``[DONE]``. *Hung*: no end at all within ``--time-limit`` seconds, when
  everything is cancelled (should be 0);
- every ``--sample-interval`` seconds: the RSS (``VmRSS``) and open fds of the server and
  each of its descendants (engine core, detokenizer), at the start, peak and end of the
  load; the scheduler gauges from ``/metrics`` and how long that scrape took (how
  responsive the API server's event loop stays under the load);
- after the load: the fds and RSS again once the clients' connections are closed,
  ``GET /health`` and one ordinary request. ``--rounds N`` repeats the load (new prompts)
  against the same server: an RSS that keeps growing from round to round is a leak, one
  that stays at the first round's level is the allocator's high-water mark. At the end
  (own server only) SIGINT and its exit status;
- CPU seconds of every process during the load, this client's included, and those of
  every other process of the machine (other programs competing for the cores);
- the kernel's TCP counters over the load (listen-queue overflows, SYN cookies, resets):
  a burst of connections larger than the server's listen backlog shows up there.

Each client is one Trio task with its own TCP connection and a raw h11 state machine (the
same HTTP parser httpx uses). One ``httpx.AsyncClient`` for all of them cost about twice the
CPU: its pool assigns requests to connections in time quadratic in their number, which
showed at a thousand. The client's own CPU time and event-loop lag are reported so that it
can be compared with the server's. The soft ``RLIMIT_NOFILE`` is raised to the hard limit
before the server starts, so the server inherits it too.

Server processes of other programs compete for the same cores: run it on a quiet machine.

Prints a summary; ``--json PATH`` also writes every figure, the samples and each client's
record. SIGINT or SIGTERM cuts the running load short, and the figures so far are still
reported and the server stopped. Exits 1 if a client hung, the server died or was
unhealthy after the load, a signal cut the soak short, or (unless ``--allow-errors``) any
client got an error.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import random
import re
import resource
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import h11
import httpx
import trio
from common import SONNETS, SchedulerMaxima, percentile, print_table, write_json
from process_cpu import CLOCK_TICKS, cpu_seconds, role

from tests.support.procfs import command_line, descendants, is_running
from tests.support.server_process import ServerProcess
from tests.support.sse import DONE, delta_text
from trio_llm.config import DEFAULT_MODEL

MIB = 1024 * 1024
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
RECEIVE_SIZE = 65536
_LOG_PROBLEM = re.compile(r"warn|error|exception|traceback", re.IGNORECASE)


# --- the clients -------------------------------------------------------------------------


@dataclass
class ClientRecord:
    """How one client's request went; times are seconds since the load started."""

    index: int
    route: str
    sent: float | None = None
    connected: float | None = None  # TCP connection established
    headers: float | None = None  # response status line and headers received
    first_token: float | None = None  # first event that carried text
    ended: float | None = None  # None: no end at all (hung)
    status: int | None = None
    done: bool = False  # saw data: [DONE]
    text_events: int = 0
    completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None  # the kind; None if none
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.done and self.first_token is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        if self.first_token is None or self.sent is None:
            return None
        return self.first_token - self.sent


class SSEDecoder:
    """Server-sent events from a byte stream: the ``data`` of each event.

    Follows the event-stream format: lines end at CR LF, LF or CR; an event ends at a blank
    line; lines starting with ``:`` are comments; one space after the field's colon is
    dropped; several ``data`` lines join with LF; an event cut off by the end of the stream
    is discarded. UTF-8 characters and CR LF pairs may be split across chunks.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""  # an unfinished line
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that ``chunk`` completes."""
        text = self._pending + self._utf8.decode(chunk)
        # A final CR may be the first half of CR LF: keep it for the next chunk.
        cut = len(text) - 1 if text.endswith("\r") else len(text)
        lines = _LINE_BREAK.split(text[:cut])
        self._pending = lines.pop() + text[cut:]
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value.removeprefix(" "))
        return events


class Connection:
    """One HTTP/1.1 request on its own TCP connection, with h11 (lighter than an httpx pool
    of a thousand connections, whose request assignment is quadratic in them)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def send_request(self, method: str, target: str, headers: list, body: bytes) -> None:
        request = h11.Request(method=method, target=target, headers=headers)
        data = self.h11.send(request) + self.h11.send(h11.Data(data=body))
        await self.stream.send_all(data + self.h11.send(h11.EndOfMessage()))

    async def next_event(self) -> Any:
        """The next h11 event (``Response``, ``Data``, ``EndOfMessage``), reading as needed."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(RECEIVE_SIZE))


@dataclass(frozen=True)
class Target:
    """Where the clients connect, and the headers every request carries."""

    host: str
    port: int
    prefix: str
    headers: list[tuple[str, str]]

    @classmethod
    def from_url(cls, url: str, api_key: str | None) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"need an http:// URL, got {url!r}")
        port = parts.port or 80
        headers = [
            ("host", parts.netloc),
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
        ]
        if api_key:
            headers.append(("authorization", f"Bearer {api_key}"))
        return cls(parts.hostname, port, parts.path.rstrip("/"), headers)


async def run_client(
    target: Target, record: ClientRecord, body: bytes, clock: Callable[[], float]
) -> None:
    """Send one streamed request and fill ``record``; a cancellation leaves it unended."""
    path = "/v1/chat/completions" if record.route == "chat" else "/v1/completions"
    headers = [*target.headers, ("content-length", str(len(body)))]
    record.sent = clock()
    try:
        stream = await trio.open_tcp_stream(target.host, target.port)
        record.connected = clock()
        async with stream:
            conn = Connection(stream)
            await conn.send_request("POST", target.prefix + path, headers, body)
            response = await conn.next_event()
            while isinstance(response, h11.InformationalResponse):
                response = await conn.next_event()
            if not isinstance(response, h11.Response):  # ConnectionClosed
                record.error, record.detail = "transport: closed early", repr(response)
                record.ended = clock()
                return
            record.headers = clock()
            record.status = response.status_code
            if response.status_code != 200:
                content = b""
                while isinstance(event := await conn.next_event(), h11.Data):
                    content += event.data
                record.error = f"HTTP {response.status_code}"
                record.detail = content[:300].decode(errors="replace")
            else:
                await read_stream(conn, record, clock)
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
        record.error = f"transport: {type(cause or exc).__name__}"
        record.detail = str(cause or exc)[:300]
    record.ended = clock()


async def read_stream(conn: Connection, record: ClientRecord, clock: Callable[[], float]) -> None:
    """Read the event stream to its end, counting text events and noting problems."""

    def problem(kind: str, detail: str) -> None:
        if record.error is None:
            record.error, record.detail = kind, detail[:300]

    decoder = SSEDecoder()
    while True:
        event = await conn.next_event()
        if isinstance(event, h11.EndOfMessage):
            break
        if not isinstance(event, h11.Data):  # ConnectionClosed before the end of the body
            problem("transport: closed early", repr(event))
            break
        for data in decoder.feed(event.data):
            if record.done:
                problem("data after [DONE]", data)
                continue
            if data == DONE:
                record.done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                problem("malformed event", data)
                continue
            if not isinstance(chunk, dict):
                problem("malformed event", data)
            elif "error" in chunk:
                error = chunk["error"]
                message = error.get("message", "") if isinstance(error, dict) else data
                problem("error event", message)
            else:
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"].get("completion_tokens")
                if delta_text(chunk):
                    record.text_events += 1
                    if record.first_token is None:
                        record.first_token = clock()
    if not record.done:
        problem("no [DONE]", "the stream ended without data: [DONE]")
    elif record.first_token is None:
        problem("no token", "[DONE] before any text")


def sonnet_texts(count: int, lines_each: int, seed: int) -> list[str]:
    """``count`` prompts, each ``lines_each`` consecutive sonnet lines from a random start."""
    lines = [line.strip() for line in SONNETS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        start = rng.randrange(len(lines))
        texts.append("\n".join(lines[(start + k) % len(lines)] for k in range(lines_each)))
    return texts


def request_body(args: argparse.Namespace, route: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


# --- the server's processes --------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in bytes (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def fd_count(pid: int) -> int | None:
    """Open file descriptors of ``pid`` (None if it is gone or not ours to read)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


@dataclass
class ProcessStats:
    """RSS, fds and CPU time of one process of the server's tree, over the soak."""

    pid: int
    role: str
    rss_start: int | None = None  # before the first round
    rss_peak: int = 0
    rss_load_end: int | None = None  # the last sample while clients were running
    rss_after: list[int | None] = field(default_factory=list)  # after each round
    fds_start: int | None = None
    fds_peak: int = 0
    fds_after: list[int | None] = field(default_factory=list)
    cpu_load: float = 0.0  # CPU seconds during the loads (all rounds)
    cpu_round_start: float | None = None
    gone: bool = False

    def sample(self) -> tuple[int | None, int | None]:
        rss, fds = rss_bytes(self.pid), fd_count(self.pid)
        if rss is None:
            self.gone = True
            return None, None
        self.rss_peak = max(self.rss_peak, rss)
        if fds is not None:
            self.fds_peak = max(self.fds_peak, fds)
        return rss, fds


class ProcessWatch:
    """Samples the server and every descendant of it (engine core, detokenizer, ...)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.procs: dict[int, ProcessStats] = {}
        self.series: list[dict[str, Any]] = []  # {"round", "t": s, "<role> <pid>": MiB, ...}
        self.server_died_at: str | None = None
        self.rescan_s = 5.0
        self._scanned = -math.inf
        self._pids: list[int] = []

    def _tree(self, rescan: bool = False) -> list[int]:
        """The server and its descendants; /proc is scanned for them at most every 5 s."""
        now = time.monotonic()
        if rescan or now - self._scanned >= self.rescan_s:
            self._pids = [self.server_pid, *sorted(descendants(self.server_pid))]
            self._scanned = now
        return self._pids

    def _stats(self, pid: int) -> ProcessStats:
        if pid not in self.procs:
            self.procs[pid] = ProcessStats(pid, role(pid, self.server_pid))
        return self.procs[pid]

    def start(self) -> None:
        """The baseline, before the first round."""
        for pid in self._tree(rescan=True):
            stats = self._stats(pid)
            stats.rss_start, stats.fds_start = stats.sample()

    def round_start(self) -> None:
        for pid in self._tree(rescan=True):
            self._stats(pid).cpu_round_start = _cpu(pid)

    def sample(self, round_index: int, t: float) -> None:
        point: dict[str, Any] = {"round": round_index + 1, "t": round(t, 2)}
        for pid in self._tree():
            stats = self._stats(pid)
            if stats.cpu_round_start is None:  # started during this round
                stats.cpu_round_start = 0.0
            rss, fds = stats.sample()
            if rss is not None:
                stats.rss_load_end = rss
                point[f"{stats.role} {pid}"] = round(rss / MIB, 1)
                point[f"{stats.role} {pid} fds"] = fds
        self.series.append(point)
        if self.server_died_at is None and not is_running(self.server_pid):
            self.server_died_at = f"{t:.1f} s into round {round_index + 1}"

    def load_over(self) -> float:
        """CPU seconds the tree used during this round's load."""
        total = 0.0
        for pid, stats in self.procs.items():
            used = _cpu(pid)
            if used is not None and stats.cpu_round_start is not None:
                stats.cpu_load += used - stats.cpu_round_start
                total += used - stats.cpu_round_start
            stats.cpu_round_start = None
        return total

    def fds_back(self) -> bool:
        """True when no process of the tree has more fds open than before the first round."""
        for pid, stats in self.procs.items():
            fds = fd_count(pid)
            if fds is not None and stats.fds_start is not None and fds > stats.fds_start:
                return False
        return True

    def after(self, round_index: int) -> None:
        """RSS and fds after round ``round_index`` (0-based)."""
        for pid in self._tree(rescan=True):
            stats = self._stats(pid)
            missing = round_index - len(stats.rss_after)
            stats.rss_after += [None] * missing
            stats.fds_after += [None] * missing
            rss, fds = stats.sample()
            stats.rss_after.append(rss)
            stats.fds_after.append(fds)
        for stats in self.procs.values():
            stats.gone = not is_running(stats.pid)


def _cpu(pid: int) -> float | None:
    try:
        return cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def listening_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on ``port`` (Linux; None if unknown)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    return int(entry)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return None


def other_servers(server_pid: int | None) -> list[int]:
    """trio_llm processes that are neither this program nor the server under test's tree."""
    ours = {os.getpid()}
    if server_pid is not None:
        ours |= {server_pid, *descendants(server_pid)}
    return sorted(
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and int(entry) not in ours and "trio_llm" in command_line(int(entry))
    )


def machine_cpu_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))
    return busy / CLOCK_TICKS


#: Kernel TCP counters (/proc/net/netstat, /proc/net/snmp) that show a full listen queue.
TCP_COUNTERS = (
    "TcpExt:ListenOverflows",
    "TcpExt:ListenDrops",
    "TcpExt:SyncookiesSent",
    "TcpExt:SyncookiesRecv",
    "TcpExt:SyncookiesFailed",
    "Tcp:AttemptFails",
    "Tcp:EstabResets",
)


def tcp_counters() -> dict[str, int]:
    """The `TCP_COUNTERS` of this network namespace now (all its processes, not only ours)."""
    values: dict[str, int] = {}
    for table in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            rows = Path(table).read_text().splitlines()
        except FileNotFoundError:
            continue
        for names, numbers in zip(rows[::2], rows[1::2], strict=False):
            prefix, _, fields = names.partition(" ")
            for name, number in zip(fields.split(), numbers.split()[1:], strict=False):
                key = f"{prefix}{name}"
                if key in TCP_COUNTERS:
                    values[key] = int(number)
    return values


# --- the run -----------------------------------------------------------------------------


@dataclass
class MetricsSamples(SchedulerMaxima):
    """Scheduler gauges from /metrics during the load, and how long each scrape took."""

    scrape_s: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)


async def poll_metrics(
    monitor: httpx.AsyncClient, samples: MetricsSamples, interval: float
) -> None:
    """Scrape /metrics every ``interval`` seconds (one at a time) until cancelled."""
    while True:
        start = time.perf_counter()
        try:
            response = await monitor.get("/metrics")
        except httpx.HTTPError as exc:
            samples.failures[type(exc).__name__] += 1
        else:
            samples.scrape_s.append(time.perf_counter() - start)
            if response.status_code != 200:
                samples.failures[f"HTTP {response.status_code}"] += 1
            samples.add_scrape(response.text)
        await trio.sleep(max(0.0, interval - (time.perf_counter() - start)))


async def measure_lag(lags: list[float], interval: float = 0.1) -> None:
    """How late this client's own event loop wakes up (is the client keeping up?)."""
    while True:
        start = time.perf_counter()
        await trio.sleep(interval)
        lags.append(time.perf_counter() - start - interval)


async def timed(call: Awaitable[httpx.Response], limit: float) -> tuple[int | str, float]:
    """(status or error kind, seconds) of one request, within ``limit`` seconds."""
    start = time.perf_counter()
    result: int | str = "timed out"
    with trio.move_on_after(limit):
        try:
            result = (await call).status_code
        except httpx.HTTPError as exc:
            result = type(exc).__name__
    return result, time.perf_counter() - start


class Stopper:
    """SIGINT or SIGTERM ends the current load at once (its clients are cut off and reported
    as unfinished) and the soak after that round's checks; a second signal ends everything.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self.load: trio.CancelScope | None = None  # the running load, if any

    async def watch_signals(self, everything: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self.signal is not None:
                    everything.cancel()
                self.signal = signal.Signals(signum).name
                if self.load is not None:
                    self.load.cancel()


async def soak(
    args: argparse.Namespace, url: str, watch: ProcessWatch | None
) -> tuple[list[dict[str, Any]], str | None]:
    """``--rounds`` rounds of the load against one server: the result of each round that
    ran, and the name of the signal (SIGINT, SIGTERM) that cut the soak short, if any.
    """
    results: list[dict[str, Any]] = []
    stopper = Stopper()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stopper.watch_signals, nursery.cancel_scope)
        if watch is not None:
            watch.start()
        for r in range(args.rounds):
            results.append(await load_round(args, url, watch, r, stopper))
            if stopper.signal is not None:
                break
        nursery.cancel_scope.cancel()
    return results, stopper.signal


async def load_round(
    args: argparse.Namespace,
    url: str,
    watch: ProcessWatch | None,
    round_index: int,
    stopper: Stopper,
) -> dict[str, Any]:
    """One round: the load with sampling alongside it, then the checks after it."""
    n = args.clients
    texts = sonnet_texts(n, args.prompt_lines, args.seed + round_index)
    chat = [int((i + 1) * args.chat_share) > int(i * args.chat_share) for i in range(n)]
    records = [ClientRecord(i, "chat" if chat[i] else "completions") for i in range(n)]
    bodies = [json.dumps(request_body(args, r.route, texts[r.index])).encode() for r in records]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    target = Target.from_url(url, args.api_key)
    metrics = MetricsSamples()
    lags: list[float] = []
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    fired = trio.Event()
    server_pid = watch.server_pid if watch is not None else None
    others = set(other_servers(server_pid))
    load_average = os.getloadavg()
    if watch is not None:
        watch.round_start()
    client_cpu = time.process_time()
    machine_cpu = machine_cpu_seconds()
    server_cpu = 0.0
    counters = tcp_counters()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as monitor:

        async def one(i: int, task_status: trio.TaskStatus[None]) -> None:
            task_status.started()
            await fired.wait()
            if args.ramp > 0:
                await trio.sleep_until(start_at + args.ramp * i / n)
            await run_client(target, records[i], bodies[i], clock)

        async def sample_processes(watch: ProcessWatch) -> None:
            while True:
                watch.sample(round_index, clock())
                await trio.sleep(args.sample_interval)

        with trio.move_on_after(args.time_limit) as limit:
            stopper.load = limit
            if stopper.signal is not None:
                limit.cancel()
            async with trio.open_nursery() as side:
                side.start_soon(poll_metrics, monitor, metrics, args.sample_interval)
                side.start_soon(measure_lag, lags)
                async with trio.open_nursery() as load:
                    for i in range(n):
                        await load.start(one, i)  # parked until `fired`
                    t0 = time.perf_counter()
                    start_at = trio.current_time()
                    if watch is not None:
                        side.start_soon(sample_processes, watch)
                    fired.set()
                side.cancel_scope.cancel()
        stopper.load = None
        interrupted = stopper.signal if limit.cancelled_caught else None
        wall = clock()
        if watch is not None:
            watch.sample(round_index, wall)
            server_cpu = watch.load_over()
    client_cpu = time.process_time() - client_cpu
    machine_cpu = machine_cpu_seconds() - machine_cpu
    counters = {k: v - counters.get(k, 0) for k, v in tcp_counters().items()}
    others |= set(other_servers(server_pid))
    # Every connection of the load is closed now; the server closes its ends when it notices.
    settle_s = None
    if watch is not None:
        with trio.move_on_after(args.settle):
            while not watch.fds_back():  # noqa: ASYNC110 - /proc can only be polled
                await trio.sleep(0.25)
            settle_s = clock() - wall
        watch.after(round_index)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as after:
        health, health_s = await timed(after.get("/health"), 30)
        final_body = {"prompt": texts[0], "max_tokens": args.max_tokens, "temperature": 0.0}
        final, final_s = await timed(after.post("/v1/completions", json=final_body), 120)
    return {
        "records": records,
        "wall_s": wall,
        "time_limit_hit": limit.cancelled_caught and interrupted is None,
        "interrupted": interrupted,
        "metrics": metrics,
        "client_lag_s": lags,
        "client_cpu_s": client_cpu,
        "health": health,
        "health_s": health_s,
        "final": final,
        "final_s": final_s,
        "fds_settle_s": settle_s,
        "watched": watch is not None,
        "tcp_counters": counters,
        "load_average_at_start": load_average,
        "other_trio_llm_processes": sorted(others),
        "server_cpu_s": server_cpu,
        "other_cpu_s": machine_cpu - client_cpu - server_cpu,
    }


# --- the report --------------------------------------------------------------------------


def analyse(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one round."""
    records: list[ClientRecord] = result["records"]
    completed = [r for r in records if r.completed]
    hung = [r for r in records if r.ended is None]
    errors = Counter(r.error for r in records if r.ended is not None and r.error is not None)
    ttft = [t for r in completed if (t := r.ttft) is not None]
    connect = [
        r.connected - r.sent for r in records if r.connected is not None and r.sent is not None
    ]
    headers = [r.headers - r.sent for r in records if r.headers is not None and r.sent is not None]
    tokens = sum(
        r.completion_tokens if r.completion_tokens is not None else r.text_events for r in records
    )
    wrong_length = [
        r.index for r in completed if (r.completion_tokens or r.text_events) != args.max_tokens
    ]
    metrics: MetricsSamples = result["metrics"]
    lags: list[float] = result["client_lag_s"]
    return {
        "clients": len(records),
        "completed": len(completed),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "first_error": next(
            (f"client {r.index}: {r.error}: {r.detail}" for r in records if r.error), None
        ),
        "hung": len(hung),
        "time_limit_hit": result["time_limit_hit"],
        "interrupted": result["interrupted"],
        "wrong_length": len(wrong_length),
        "wall_s": result["wall_s"],
        "output_tokens": tokens,
        "output_tok_per_s": tokens / result["wall_s"] if result["wall_s"] else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft, default=0.0),
        "connect_p50_s": percentile(connect, 50),
        "connect_p99_s": percentile(connect, 99),
        "connect_max_s": max(connect, default=0.0),
        "headers_p50_s": percentile(headers, 50),
        "headers_p99_s": percentile(headers, 99),
        "headers_max_s": max(headers, default=0.0),
        "metrics_scrapes": len(metrics.scrape_s),
        "metrics_scrape_p50_s": percentile(metrics.scrape_s, 50),
        "metrics_scrape_max_s": max(metrics.scrape_s, default=0.0),
        "metrics_scrape_failures": dict(metrics.failures),
        "scheduler_max_waiting": metrics.max_waiting,
        "scheduler_max_running": metrics.max_running,
        "kv_cache_max_usage": metrics.max_kv_usage,
        "preemptions": metrics.preemptions,
        "client_cpu_s": result["client_cpu_s"],
        "client_loop_lag_max_s": max(lags, default=0.0),
        "client_rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "health_after": result["health"],
        "health_after_s": result["health_s"],
        "final_request": result["final"],
        "final_request_s": result["final_s"],
        "fds_settle_s": result["fds_settle_s"],
        "watched": result["watched"],
        "tcp_counters": result["tcp_counters"],
        "load_average_at_start": result["load_average_at_start"],
        "other_trio_llm_processes": result["other_trio_llm_processes"],
        "server_cpu_s": result["server_cpu_s"],
        "other_cpu_s": result["other_cpu_s"],
    }


def _mib(value: int | None) -> float | None:
    return None if value is None else value / MIB


def process_rows(watch: ProcessWatch, rounds: int) -> list[dict[str, Any]]:
    """One row per process: RSS (MiB) and fds before, at peak and after each round."""

    def suffix(r: int) -> str:
        return "" if rounds == 1 else f"_r{r + 1}"

    rows = []
    for s in watch.procs.values():
        row: dict[str, Any] = {"process": s.role, "pid": s.pid}
        row["rss_start_MiB"] = _mib(s.rss_start)
        row["rss_peak_MiB"] = _mib(s.rss_peak)
        row["rss_load_end_MiB"] = _mib(s.rss_load_end)
        for r in range(rounds):
            row[f"rss_after{suffix(r)}_MiB"] = _mib(_at(s.rss_after, r))
        row["fds_start"] = s.fds_start
        row["fds_peak"] = s.fds_peak
        for r in range(rounds):
            row[f"fds_after{suffix(r)}"] = _at(s.fds_after, r)
        row["cpu_load_s"] = s.cpu_load
        rows.append(row)
    return rows


def _at(values: list[int | None], index: int) -> int | None:
    return values[index] if index < len(values) else None


def log_problems(path: Path | None) -> list[str]:
    """Lines of the server's log that look like warnings or errors."""
    if path is None or not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if _LOG_PROBLEM.search(line)]


def round_summary(figures: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, value) lines of one round's figures."""
    failures = figures["metrics_scrape_failures"]
    settle = figures["fds_settle_s"]
    counters = figures["tcp_counters"]
    return [
        ("completed", f"{figures['completed']} / {figures['clients']}"),
        ("errors", f"{figures['errors']} {figures['errors_by_kind'] or ''}".strip()),
        (
            f"unfinished when {figures['interrupted']} cut the load short"
            if figures["interrupted"]
            else "hung (no end by the time limit)",
            figures["hung"],
        ),
        ("completed with other than max-tokens tokens", figures["wrong_length"]),
        ("wall time", f"{figures['wall_s']:.1f} s"),
        ("output tokens", figures["output_tokens"]),
        ("output tok/s", f"{figures['output_tok_per_s']:.1f}"),
        ("TTFT p50 / p99 / max", _secs(figures, "ttft")),
        ("TCP connect p50 / p99 / max", _secs(figures, "connect")),
        ("response headers p50 / p99 / max", _secs(figures, "headers")),
        (
            "/metrics scrape during load p50 / max",
            f"{figures['metrics_scrape_p50_s']:.3f} / {figures['metrics_scrape_max_s']:.3f} s "
            f"({figures['metrics_scrapes']} scrapes{f', failures {failures}' if failures else ''})",
        ),
        (
            "scheduler max running / waiting",
            f"{figures['scheduler_max_running']:.0f} / {figures['scheduler_max_waiting']:.0f}",
        ),
        (
            "KV cache max usage, preemptions",
            f"{figures['kv_cache_max_usage']:.1%}, {figures['preemptions']:.0f}",
        ),
        (
            "client loop lag max, RSS peak",
            f"{figures['client_loop_lag_max_s'] * 1000:.0f} ms, "
            f"{figures['client_rss_peak_mib']:.0f} MiB",
        ),
        (
            "kernel TCP counters during the load",
            " ".join(f"{k.partition(':')[2]} {v}" for k, v in counters.items()) or "n/a",
        ),
        (
            "server fds back to their start",
            "not measured"
            if not figures["watched"]
            else f"{settle:.1f} s after the load"
            if settle is not None
            else "not within --settle",
        ),
        (
            "CPU seconds: server, this client, others",
            f"{figures['server_cpu_s']:.1f}, {figures['client_cpu_s']:.1f}, "
            f"{figures['other_cpu_s']:.1f} (of {figures['wall_s'] * (os.cpu_count() or 1):.0f} "
            f"on {os.cpu_count()} CPUs; other trio_llm processes: "
            f"{figures['other_trio_llm_processes'] or 'none'}; load average at start "
            f"{', '.join(f'{x:.2f}' for x in figures['load_average_at_start'])})",
        ),
        ("GET /health after", f"{figures['health_after']} ({figures['health_after_s']:.3f} s)"),
        (
            "one more completion after",
            f"{figures['final_request']} ({figures['final_request_s']:.2f} s)",
        ),
    ]


def report(
    args: argparse.Namespace,
    common: dict[str, Any],
    rounds: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    problems: list[str],
    failures: list[str],
) -> None:
    print(
        f"\nsoak: {args.clients} concurrent streaming clients ({args.chat_share:.0%} chat), "
        f"{args.max_tokens} output tokens each, ramp {args.ramp:g} s, "
        f"{args.rounds} round(s) of at most {args.time_limit:g} s; {os.cpu_count()} CPUs"
    )
    for r, figures in enumerate(rounds):
        lines = round_summary(figures)
        if len(rounds) > 1:
            print(f"round {r + 1} of {len(rounds)}:")
        width = max(len(k) for k, _ in lines)
        for key, value in lines:
            print(f"  {key.ljust(width)}  {value}")
        if figures["first_error"]:
            print(f"  first error: {figures['first_error']}")
    if "server_exit" in common:
        print(f"server SIGINT: {common['server_exit']}")
    if rows:
        print(
            "\nserver processes (RSS in MiB; load_end: last sample under load; after: once the "
            "server's fds were back to their start or --settle passed; CPU seconds under load):"
        )
        print_table(rows, list(rows[0]))
    if problems:
        print(f"\nserver log: {len(problems)} warning/error lines, the first ones:")
        for line in problems[:10]:
            print(f"  {line[:200]}")
    if failures:
        print("\nFAILED:")
        for line in failures:
            print(f"  {line}")
    else:
        print("\nOK: every client ended, the server stayed up and healthy")


def _secs(figures: dict[str, Any], name: str) -> str:
    return (
        f"{figures[f'{name}_p50_s']:.2f} / {figures[f'{name}_p99_s']:.2f} / "
        f"{figures[f'{name}_max_s']:.2f} s"
    )


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; (soft, hard) after. Children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        print(
            f"warning: RLIMIT_NOFILE hard limit {hard} is below the {needed} descriptors "
            "this soak needs (client and server each); connections may fail with EMFILE",
            file=sys.stderr,
        )
    return soft, hard


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by {signal.Signals(signum).name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chat-share", type=float, default=0.2, help="0..1 of clients on chat")
    parser.add_argument("--prompt-lines", type=int, default=2, help="sonnet lines per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds to spread starts over")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds for the load")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="seconds")
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds to wait after the load for the server's fd counts to return to the start",
    )
    parser.add_argument("--rounds", type=int, default=1, help="loads, one after the other")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --url (default: the port's owner)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--detokenizer-mode", choices=["inline", "process"], default=None)
    parser.add_argument(
        "--server-args", default="", help="more `serve` flags, e.g. --server-args='--seed 1'"
    )
    parser.add_argument("--log", type=Path, help="server log file (default: a temp folder)")
    parser.add_argument("--allow-errors", action="store_true", help="errors do not fail the run")
    parser.add_argument("--json", help="also write the figures, samples and clients here")
    args = parser.parse_args()
    if not 0 <= args.chat_share <= 1:
        parser.error("--chat-share must be within 0..1")
    if args.clients < 1 or args.rounds < 1:
        parser.error("--clients and --rounds must be at least 1")

    soft, hard = raise_fd_limit(args.clients + 256)
    # Outside the soak itself (which handles signals in Trio) a SIGTERM must still run the
    # `finally` that stops the server. SIGINT may be ignored (a background job's is).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    server: ServerProcess | None = None
    log: Path | None = args.log
    common: dict[str, Any] = {"rlimit_nofile": [soft, hard]}
    failures: list[str] = []
    try:
        if args.url:
            url = args.url.rstrip("/")
            server_pid = args.server_pid
            if server_pid is None:
                port = httpx.URL(url).port or 80
                server_pid = listening_pid(port)
                if server_pid is None:
                    print(f"note: no process of ours listens on port {port}; no RSS/fd figures")
        else:
            server_args = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs)]
            if args.detokenizer_mode:
                server_args += ["--detokenizer-mode", args.detokenizer_mode]
            server_args += shlex.split(args.server_args)
            log = log or Path(tempfile.mkdtemp(prefix="trio-llm-soak-")) / "server.log"
            server = ServerProcess(server_args, log_path=log)
            started = time.perf_counter()
            server.start()
            url, server_pid = server.url, server.pid
            common["server_args"] = server_args
            common["server_start_s"] = time.perf_counter() - started
            print(f"server {url} (pid {server_pid}) started in {common['server_start_s']:.1f} s")
            print(f"server log: {log}")
        watch = ProcessWatch(server_pid) if server_pid is not None else None
        busy = other_servers(server_pid)
        if busy:
            print(f"warning: other trio_llm processes share these CPUs: {busy}", file=sys.stderr)
        results, interrupted = trio.run(soak, args, url, watch)
        if interrupted and len(results) < args.rounds:
            failures.append(f"{interrupted} stopped the soak after {len(results)} round(s)")
        if server is not None:
            stopped = time.perf_counter()
            code = server.stop(timeout=60)
            common["server_exit"] = f"exit {code} after {time.perf_counter() - stopped:.1f} s"
            if code != 0:
                failures.append(f"the server exited {code} on SIGINT")
    finally:
        if server is not None:
            server.close()

    rounds = [analyse(args, result) for result in results]
    rows = process_rows(watch, len(rounds)) if watch is not None else []
    problems = log_problems(log)
    common["server_log_problem_lines"] = len(problems)
    if watch is not None and watch.server_died_at is not None:
        failures.append(f"the server died {watch.server_died_at}")
    for r, figures in enumerate(rounds, 1):
        if figures["interrupted"]:
            failures.append(
                f"round {r}: {figures['interrupted']} cut the load short with "
                f"{figures['hung']} clients unfinished"
            )
        elif figures["hung"]:
            failures.append(
                f"round {r}: {figures['hung']} clients hung (no end within {args.time_limit:g} s)"
            )
        if figures["health_after"] != 200 or figures["final_request"] != 200:
            failures.append(
                f"after round {r}: /health {figures['health_after']}, "
                f"a completion {figures['final_request']}"
            )
        if figures["errors"] and not args.allow_errors:
            failures.append(
                f"round {r}: {figures['errors']} clients got errors: {figures['errors_by_kind']}"
            )
    report(args, common, rounds, rows, problems, failures)
    write_json(
        args.json,
        {
            "figures": common,
            "rounds": rounds,
            "failures": failures,
            "processes": rows,
            "server_log_problems": problems[:100],
            "samples": watch.series if watch is not None else [],
            "clients": [[asdict(c) for c in result["records"]] for result in results],
            "args": {k: str(v) for k, v in vars(args).items()},
        },
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
