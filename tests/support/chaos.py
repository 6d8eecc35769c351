"""Chaos trials: start a server, load it, inject one fault, check that everything ends well.

Used by ``bench/chaos.py`` (the long run, with a summary table) and ``tests/chaos`` (a
short seeded sample in ``make test``). One trial:

1. start ``trio-llm serve`` (2 or 3 processes, restart on or off) and record its process
   tree, its listening sockets and its open file descriptors;
2. put it under load: streaming and non-streaming HTTP requests, WebSocket generations,
   and clients that leave after their first token, each on a fresh connection;
3. after a random delay inject one fault (`FAULTS`);
4. wait for the consequence: the server exits, or (restart on) serves a normal request
   again, or (a harmless fault) goes on serving;
5. stop the load; stop a surviving server with SIGTERM;
6. check: every request ended (complete, explicit error, or refused) in time; nothing was
   lost; no process of the tree is left running or unreaped; no file descriptor leaked
   in a surviving server; the only listening socket of the tree was the HTTP port; the
   port is free afterwards; the exit status is the documented one (docs/shutdown.md).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.support.procfs import (
    count_fds,
    descendants,
    detokenizer_children,
    engine_children,
    fd_targets,
    listening_sockets,
    parent_pid,
    process_state,
    socket_inode,
    tcp_sockets,
    wait_for_exit,
)
from tests.support.server_process import ServerProcess
from trio_llm.client import ConnectionClosedError, GenerationError, open_ws_client

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: Every fault a trial can inject.
FAULTS = (
    "sigkill-server",
    "sigterm-server",
    "sigint-server",
    "sigkill-engine",
    "sigterm-engine",
    "sigint-engine",
    "sigkill-detokenizer",
    "sigterm-detokenizer",
    "sigint-detokenizer",
    "sigstop-engine",
    "stuck-client",
    "burst",
    "hostile-client",
)

#: What a "hostile-client" fault does (the trial's seed picks one; issue 14's triggers).
HOSTILE_TRIGGERS = (
    "ws-early-byte",  # a byte behind a WebSocket upgrade (killed the server once)
    "smuggling",  # Content-Length and Transfer-Encoding together
    "many-prompts",  # 1.5 M prompts in one 7.5 MB body
    "stop-strings",  # the most and longest stop strings allowed
    "surrogate",  # a lone surrogate in a stop string
    "hog",  # n = --max-num-seqs with a long output, never read
    "long-prompt",  # a prompt almost as long as the context
)

#: Server settings of every trial (seconds, counts). Steps stay short (a small token
#: budget per step), so a legitimate step never comes near the step timeout, even on a
#: busy machine where the first steps of a fresh engine take a few seconds.
STEP_TIMEOUT = 10.0
MAX_BATCHED_TOKENS = 256
SHUTDOWN_TIMEOUT = 4.0
MAX_WAITING = 24
#: A disrupted request must end within this many seconds of the fault (plus the drain).
END_DEADLINE = 5.0
#: A restarted engine must serve again within this many seconds of the fault.
RESTART_DEADLINE = 60.0
#: Seconds a request waits for a restarting engine before its 503 (--engine-restart-wait).
RESTART_WAIT = 20.0
#: Any request must end within this many seconds of being sent (waiting for a restarted
#: engine included).
REQUEST_LIMIT = RESTART_WAIT + 25.0
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

    def server_args(self) -> list[str]:
        """Command-line flags of this trial's server."""
        args = [
            # One torch thread: two trials can run side by side on two cores without
            # oversubscribing them (busy-waiting thread pools then crawl).
            "--num-threads",
            "1",
            "--max-num-seqs",
            "16",
            "--kv-cache-memory",
            "256MiB",
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            str(MAX_BATCHED_TOKENS),
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
    def server_stops(self) -> bool:
        """The fault ends the server (by a signal to it, or an engine failure w/o restart)."""
        return self.fault.endswith("-server") or (self.engine_fails and not self.restart)

    @property
    def expected_exit(self) -> int:
        """The documented exit status for this fault (docs/shutdown.md)."""
        if self.fault == "sigkill-server":
            return -signal.SIGKILL
        if self.engine_fails and not self.restart:
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
        return (
            f"#{self.index} {self.fault}{extra} ({self.detokenizer_mode}, {restart}, "
            f"at +{self.fault_delay:.1f}s)"
        )


def plan_trials(count: int, seed: int, faults: tuple[str, ...] = FAULTS) -> list[TrialSpec]:
    """``count`` trials with the faults spread evenly, in a seeded random order."""
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
                restart=rng.random() < 0.5,
                fault_delay=rng.uniform(0.3, 3.0),
                stop_seconds=stop,
                seed=rng.randrange(2**31),
            )
        )
    return specs


@dataclass
class Record:
    """How one client request ended.

    ``outcome``: "complete", "error" (an explicit error: HTTP status with a JSON body, SSE
    error event, WebSocket error event or close code), "refused" (no connection),
    "no-response" (connection closed before any response), "cut" (the response started
    but stopped without an end), "left" (the client left on purpose), "hung".
    """

    kind: str
    start: float
    end: float = 0.0
    outcome: str = "hung"
    detail: str = ""
    phase: str = "starting"


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


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): children of a
    SIGKILLed server become ours, and a trial reaps them after checking they exited."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


class _Load:
    """Clients that send requests until told to stop; every request gets a `Record`."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.rng = rng
        self.records: list[Record] = []
        self.stop = trio.Event()

    def open_records(self) -> list[Record]:
        return [r for r in self.records if r.outcome == "hung" and not r.end]

    async def run(self, clients: dict[str, int]) -> None:
        async with trio.open_nursery() as nursery:
            for kind, count in clients.items():
                for _ in range(count):
                    nursery.start_soon(self._client, kind)

    async def _client(self, kind: str) -> None:
        while not self.stop.is_set():
            record = Record(kind, time.monotonic())
            self.records.append(record)
            with trio.move_on_after(REQUEST_LIMIT):
                record.outcome, record.detail = await self.one_request(kind, record)
            record.end = time.monotonic()
            if record.outcome == "hung":
                record.detail = f"no end after {REQUEST_LIMIT:g} s, while {record.phase}"
            if record.outcome in ("refused", "no-response", "cut"):
                record.detail += f" ({record.end - record.start:.1f} s after sending)"
            if record.outcome in ("refused", "no-response"):
                await self.stop.wait()  # the server is going away; nothing more to send

    async def one_request(self, kind: str, record: Record) -> tuple[str, str]:
        """Send one request of ``kind``; return its outcome and a detail.

        ``record.phase`` follows the request, so that one that never ends says where.
        """
        max_tokens = self.rng.randint(4, 24)
        prompt = f"Story {self.rng.randrange(1000)}:"
        if kind == "ws":
            try:
                return await self._websocket(prompt, max_tokens, record)
            except OSError as exc:
                return "refused", repr(exc)
        # When each step of the exchange happened (httpcore's trace events), so that a
        # connection closed without a response tells whose side was slow.
        seen: dict[str, float] = {}

        async def trace(name: str, info: object) -> None:
            seen.setdefault(name, time.monotonic())
            record.phase = name

        try:
            async with httpx.AsyncClient(
                base_url=self.url,
                timeout=REQUEST_LIMIT,
                limits=httpx.Limits(max_keepalive_connections=0),
            ) as client:
                if kind == "json":
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": max_tokens,
                    }
                    response = await client.post(
                        "/v1/chat/completions", json=body, extensions={"trace": trace}
                    )
                    if response.status_code == 200:
                        return "complete", ""
                    return _http_error(response)
                return await self._stream(
                    client, prompt, max_tokens, leave=kind == "leaver", trace=trace
                )
        except httpx.ConnectError as exc:
            return "refused", repr(exc)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            return "no-response", f"{exc!r}{_timeline(seen)}"
        except OSError as exc:
            return "refused", repr(exc)

    async def _stream(
        self,
        client: httpx.AsyncClient,
        prompt: str,
        max_tokens: int,
        *,
        leave: bool,
        trace: Callable[[str, object], Awaitable[None]],
    ) -> tuple[str, str]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        extensions = {"trace": trace}
        async with client.stream(
            "POST", "/v1/completions", json=body, extensions=extensions
        ) as response:
            if response.status_code != 200:
                await response.aread()
                return _http_error(response)
            error = ""
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        return ("error", error) if error else ("complete", "")
                    try:
                        event = json.loads(data)
                    except ValueError:
                        return "cut", f"malformed event: {data[:80]!r}"
                    if "error" in event:
                        error = event["error"].get("message", "")
                    elif leave:
                        return "left", ""
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                return ("error", error) if error else ("cut", repr(exc))
            return ("error", error) if error else ("cut", "stream ended without [DONE]")

    async def _websocket(self, prompt: str, max_tokens: int, record: Record) -> tuple[str, str]:
        url = self.url.replace("http://", "ws://") + "/v1/ws"
        try:
            record.phase = "ws: connecting and opening handshake"
            async with open_ws_client(url) as ws:
                record.phase = "ws: waiting for events"
                generation = ws.generate(
                    "completion",
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                )
                async with generation:
                    async for _ in generation:
                        record.phase = "ws: between events"
                record.phase = "ws: closing"
            return "complete", ""
        except GenerationError as exc:
            return "error", str(exc)
        except ConnectionClosedError as exc:
            if "opening handshake" in str(exc):
                return "no-response", str(exc)
            if exc.code == 1006:
                return "cut", str(exc)
            return "error", str(exc)
        except Exception as exc:  # trio-websocket's handshake and stream errors
            if type(exc).__name__ in ("HandshakeError", "ConnectionRejected"):
                return "no-response", repr(exc)
            raise


def _timeline(seen: dict[str, float]) -> str:
    """``" (connected +0.0 s, request sent +5.3 s, ...)"``: trace events after the first."""
    names = {
        "connection.connect_tcp.complete": "connected",
        "http11.send_request_headers.complete": "headers sent",
        "http11.send_request_body.complete": "request sent",
        "http11.receive_response_headers.failed": "read failed",
    }
    if not seen:
        return ""
    start = min(seen.values())
    parts = [f"{label} +{seen[n] - start:.1f} s" for n, label in names.items() if n in seen]
    return f" ({', '.join(parts)})"


def _http_error(response: httpx.Response) -> tuple[str, str]:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "cut", f"HTTP {response.status_code} without an error body"
    return "error", f"{response.status_code}: {message}"


async def _normal_request(url: str) -> bool:
    """One short request; True if it completed."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=RESTART_DEADLINE) as client:
            response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def open_stuck_request(port: int) -> socket.socket:
    """Connect to ``port`` and ask for a long stream that is never read (a small receive
    buffer, ``n=4`` with logprobs, so the server's writes soon block); the caller closes it.
    """
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        body = {"model": MODEL, "prompt": "Saga:", "max_tokens": 900, "ignore_eos": True}
        payload = json.dumps(body | {"logprobs": 5, "n": 4, "stream": True}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
    except BaseException:
        sock.close()
        raise
    return sock


async def _stuck_client(port: int, opened: trio.Event, done: trio.Event) -> None:
    """A client that asks for a long stream and never reads it."""
    with open_stuck_request(port) as sock:
        await trio.lowlevel.wait_readable(sock)  # the stream has begun
        opened.set()
        await done.wait()


_UPGRADE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _http_request(path: str, body: dict[str, Any], extra_headers: bytes = b"") -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n".encode()
        + extra_headers
        + b"\r\n"
        + payload
    )


def hostile_request(trigger: str) -> tuple[bytes, tuple[bytes, ...]]:
    """The bytes a hostile client of ``trigger`` sends, and the status lines it may get
    (empty: the answer does not matter, only that the server is unharmed). A stream may
    also get a 503: a request with many choices can fill the waiting line on its own."""
    if trigger == "ws-early-byte":
        return _UPGRADE + b"X", ()
    refused = (b"HTTP/1.1 400",)
    streamed = (b"HTTP/1.1 200", b"HTTP/1.1 503")
    if trigger == "smuggling":
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        return head + b"0\r\n\r\n", refused
    if trigger == "many-prompts":
        return _http_request("/v1/completions", {"prompt": ["a"] * 1_500_000}), refused
    if trigger == "surrogate":
        return _http_request("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}), refused
    if trigger == "stop-strings":
        stops = [f"{i:03d}" + "z" * 253 for i in range(64)]
        body = {"prompt": "Story:", "max_tokens": 24, "stop": stops, "stream": True}
        return _http_request("/v1/completions", body), streamed
    if trigger == "hog":
        body = {"prompt": "Count:", "n": 16, "max_tokens": 900, "ignore_eos": True}
        return _http_request("/v1/completions", body | {"stream": True}), streamed
    if trigger == "long-prompt":
        body = {"prompt": list(range(1000, 2000)), "max_tokens": 4, "stream": True}
        return _http_request("/v1/completions", body), streamed
    raise ValueError(f"unknown hostile trigger {trigger!r}")


async def _hostile_client(
    port: int, trigger: str, opened: trio.Event, done: trio.Event, result: TrialResult
) -> None:
    """Send one hostile request and check its status line; for a stream, wait for its
    first event (it has taken its place in the engine). Then hold the connection open
    without reading until ``done`` (a careless client)."""
    data, expected = hostile_request(trigger)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
        async with stream:
            await stream.send_all(data)
            answer = b""
            with trio.move_on_after(REQUEST_LIMIT):
                while expected:
                    begun = answer.startswith(b"HTTP/1.1 200") and b"data: " in answer
                    if begun or (len(answer) >= 12 and not answer.startswith(b"HTTP/1.1 200")):
                        break
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    answer += chunk
            if expected and not answer.startswith(expected):
                result.failures.append(
                    f"hostile client {trigger}: got {answer[:80]!r}, expected one of {expected}"
                )
            opened.set()
            await done.wait()
    except OSError as exc:
        result.failures.append(f"hostile client {trigger}: {exc!r}")
        opened.set()


async def _burst(url: str, count: int) -> list[Record]:
    """``count`` short non-streaming requests at once (past the waiting limit)."""
    load = _Load(url, random.Random(count))
    records = [Record("burst", time.monotonic()) for _ in range(count)]

    async def one(record: Record) -> None:
        with trio.move_on_after(REQUEST_LIMIT):
            record.outcome, record.detail = await load.one_request("json", record)
        record.end = time.monotonic()
        if record.outcome == "hung":
            record.detail = f"no end after {REQUEST_LIMIT:g} s, while {record.phase}"

    async with trio.open_nursery() as nursery:
        for record in records:
            nursery.start_soon(one, record)
    return records


def _fault_target(spec: TrialSpec, server: ServerProcess) -> int:
    if spec.fault.endswith("-server"):
        return server.pid
    found = (
        detokenizer_children(server.pid)
        if "detokenizer" in spec.fault
        else engine_children(server.pid)
    )
    if len(found) != 1:
        raise RuntimeError(f"expected one target process for {spec.fault}, found {found}")
    return found.pop()


async def run_trial(spec: TrialSpec, log_dir: Path) -> TrialResult:
    """Run one trial end to end; never raises for a failed check (see `TrialResult`)."""
    result = TrialResult(spec)
    began = time.monotonic()
    log_path = log_dir / f"trial-{spec.index:03d}.log"
    server = ServerProcess(spec.server_args(), log_path=log_path)
    tree: set[int] = set()
    try:
        await trio.to_thread.run_sync(server.start)
        await _trial_body(spec, server, result, tree)
    except Exception as exc:
        result.failures.append(f"trial error: {exc!r}")
    finally:
        server.kill()
        server.close()
        await _check_tree_gone(tree, result)
        result.seconds = time.monotonic() - began
        if not result.ok:
            result.failures.append(f"log: {log_path}")
    return result


async def _trial_body(
    spec: TrialSpec, server: ServerProcess, result: TrialResult, tree: set[int]
) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    tree |= descendants(server.pid)
    # Kernel backstop: the only listening socket of the whole tree is the HTTP port.
    for pid in {server.pid, *tree}:
        extra = [s for s in listening_sockets(pid) if s != f"tcp:{port}" or pid != server.pid]
        if extra:
            result.failures.append(f"pid {pid} listens on {extra}")
    fds_before = count_fds(server.pid)
    async with trio.open_nursery() as stuck_nursery:
        stuck_done = trio.Event()
        try:
            await _load_and_fault(spec, server, result, tree, stuck_nursery, stuck_done)
            if result.exit_code is None:
                # The stuck client still holds its connection (the shutdown must cut it).
                held = 1 if spec.fault == "stuck-client" else 0
                await _check_fds(server.pid, fds_before + held, result)
                server.send_signal(signal.SIGTERM)
                result.exit_code = await _wait_exit(server, SHUTDOWN_TIMEOUT + 15)
        finally:
            stuck_done.set()
    if result.exit_code != spec.expected_exit:
        result.failures.append(f"exit status {result.exit_code}, expected {spec.expected_exit}")
    if not _port_is_free(port):
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
    load = _Load(server.url, random.Random(spec.seed))
    burst: list[Record] = []
    hostile_done = trio.Event()  # the hostile client leaves once the server proved unharmed
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, {"sse": 4, "json": 2, "ws": 2, "leaver": 1})
        await trio.sleep(spec.fault_delay)
        open_at_fault = load.open_records()
        fault_time = time.monotonic()
        if spec.fault == "stuck-client":
            opened = trio.Event()
            port = int(server.url.rsplit(":", 1)[1])
            stuck_nursery.start_soon(_stuck_client, port, opened, stuck_done)
            await opened.wait()
        elif spec.fault == "burst":
            burst = await _burst(server.url, 3 * MAX_WAITING)
        elif spec.fault == "hostile-client":
            opened = trio.Event()
            port = int(server.url.rsplit(":", 1)[1])
            stuck_nursery.start_soon(
                _hostile_client, port, spec.hostile_trigger, opened, hostile_done, result
            )
            await opened.wait()
        else:
            target = _fault_target(spec, server)
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
        elif not await _normal_request(server.url):
            result.failures.append("the server stopped serving after a harmless fault")
        hostile_done.set()
        load.stop.set()
    if result.exit_code is None:
        tree |= descendants(server.pid)
    deadline = END_DEADLINE + (SHUTDOWN_TIMEOUT if spec.fault == "sigterm-server" else 0)
    _check_records(spec, load.records + burst, open_at_fault, fault_time, deadline, result)


async def _wait_exit(server: ServerProcess, seconds: float) -> int | None:
    """The server's exit status, or None if it still runs after ``seconds``."""
    assert server.process is not None
    with trio.move_on_after(seconds):
        await wait_for_exit(server.pid)
        return server.process.wait()
    return None


async def _recover(url: str) -> float | None:
    """Send normal requests until one completes; the time it did, or None after the
    restart deadline."""
    with trio.move_on_after(RESTART_DEADLINE):
        # Another process's state: nothing to wait on but its answers.
        while not await _normal_request(url):  # noqa: ASYNC110
            await trio.sleep(0.1)
        return time.monotonic()
    return None


def _check_records(
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
        elif record.outcome == "error" and not disrupted and spec.fault != "burst":
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


async def _check_fds(pid: int, before: int, result: TrialResult) -> None:
    """The surviving server's descriptors come back to their count before the load."""
    now = before
    with trio.move_on_after(FD_SETTLE_SECONDS):
        # Another process's descriptors: they close as its handlers finish.
        while (now := count_fds(pid)) != before:  # noqa: ASYNC110
            await trio.sleep(0.1)
    if now != before:
        result.failures.append(
            f"server holds {now} file descriptors, {before} before the load: {describe_fds(pid)}"
        )


async def _check_tree_gone(tree: set[int], result: TrialResult) -> None:
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
