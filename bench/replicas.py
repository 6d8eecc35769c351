"""Replicas behind a router: a rolling restart, a killed replica, and cache-aware routing.

    python bench/replicas.py [--replicas 2] [--clients 4] [--router vllm-router] \\
        [--max-tokens 12] [--json out.json]

Starts ``--replicas`` ``trio-llm serve`` processes on fixed loopback ports and vLLM's
router (``vllm-router``, PyPI) in front of them (``--health-check-interval-secs 1``),
then keeps ``--clients`` clients streaming chat completions through the router while it:

(a) **rolling restart**: SIGTERMs each replica in turn, waits for it to drain and exit,
    starts it again on its port and waits until it is healthy (and one more health
    interval, for the router to see it), then goes to the next;
(b) **SIGKILL**: kills one replica with SIGKILL and restarts it, counting the requests
    that failed and the time from the kill to the last failure (how long the router kept
    sending to the dead replica);
(c) **shared prefixes**: sends requests that share a few long system prompts, once with
    the router's ``cache_aware`` policy and once with ``round_robin`` (the router is
    restarted between them), and reports the fleet-wide prefix-cache hit rate from the
    replicas' /metrics.

Every request is checked: HTTP 200, a stream of chunks that ends with ``[DONE]`` and
carries no error event. Prints the counts per phase; exits 1 if the rolling restart lost
a request. Loopback only; every wait is bounded (``--deadline``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import print_table, write_json

from tests.support.server_process import ServerProcess
from tests.support.sse import DONE
from trio_llm.config import DEFAULT_MODEL

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Tally:
    """Requests of one phase: how many ended well, and each failure with its time."""

    ok: int = 0
    failures: list[tuple[float, str]] = field(default_factory=list)


class Fleet:
    """The replicas and the router, as subprocesses on fixed loopback ports."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.ports = [args.base_port + 1 + i for i in range(args.replicas)]
        self.replicas: list[ServerProcess | None] = [None] * args.replicas
        self.router: subprocess.Popen[bytes] | None = None
        self.router_url = f"http://127.0.0.1:{args.base_port}"
        self.starts = 0

    def start_replica(self, i: int) -> None:
        self.starts += 1
        flags = [
            "--port", str(self.ports[i]), "--model", self.args.model, "--dtype", "float32",
            "--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
            "--shutdown-timeout", str(self.args.shutdown_timeout),
        ]  # fmt: skip
        log = self.workdir / f"replica{i}-{self.starts}.log"
        server = ServerProcess(flags, log_path=log, env={"TRIO_LLM_API_KEY": ""})
        server.start(timeout=self.args.deadline)
        self.replicas[i] = server

    def start_router(self, policy: str) -> None:
        command = [
            self.args.router, "--host", "127.0.0.1", "--port", str(self.args.base_port),
            "--policy", policy, "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--health-check-endpoint", "/health",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.args.base_port + 99),
            "--worker-urls", *(f"http://127.0.0.1:{port}" for port in self.ports),
        ]  # fmt: skip
        log = (self.workdir / f"router-{policy}.log").open("wb")
        self.router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.args.deadline
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.router_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the router did not come up")

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.terminate()
            self.router.wait(30)
            self.router = None

    def close(self) -> None:
        self.stop_router()
        for server in self.replicas:
            if server is not None:
                server.stop()
                server.close()


async def client(url: str, tally: Tally, stop: trio.Event, body: dict[str, Any]) -> None:
    """Stream chat completions through the router until ``stop``; tally each one."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                    events = [
                        line.removeprefix("data: ")
                        async for line in response.aiter_lines()
                        if line.startswith("data: ")
                    ]
                if not events or events[-1] != DONE or any('"error"' in e for e in events):
                    raise RuntimeError(f"stream ended badly: {events[-2:]}")
                tally.ok += 1
            except Exception as exc:  # every failure is counted, with its reason
                tally.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:200]))


async def under_load(fleet: Fleet, phase: Any, body: dict[str, Any]) -> Tally:
    """Run ``phase(fleet)`` (in a thread) while the clients stream; their tally."""
    tally = Tally()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(fleet.args.clients):
            nursery.start_soon(client, fleet.router_url, tally, stop, body)
        await trio.sleep(2)  # steady load first
        result = await trio.to_thread.run_sync(phase, fleet)
        await trio.sleep(2)
        stop.set()
    tally.result = result  # type: ignore[attr-defined]
    return tally


def rolling_restart(fleet: Fleet) -> list[float]:
    """SIGTERM, drain, restart each replica in turn; seconds each replica was away."""
    away = []
    for i, server in enumerate(fleet.replicas):
        assert server is not None
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(fleet.args.deadline)
        server.close()
        if code != 0:
            raise RuntimeError(f"replica {i} exited {code} on SIGTERM")
        fleet.start_replica(i)
        time.sleep(2)  # one more health interval (1 s) and a margin, for the router
        away.append(time.monotonic() - start)
    return away


def kill_one(fleet: Fleet) -> float:
    """SIGKILL replica 0 and start it again; returns the time of the kill."""
    server = fleet.replicas[0]
    assert server is not None
    killed = time.monotonic()
    server.process.kill()  # type: ignore[union-attr]
    server.close()
    time.sleep(3)  # the router's health checks find it gone meanwhile
    fleet.start_replica(0)
    time.sleep(2)
    return killed


def prefix_hits(fleet: Fleet) -> tuple[float, float]:
    """Fleet-wide prefix-cache (queries, hits) totals from the replicas' /metrics."""
    queries = hits = 0.0
    for port in fleet.ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("trio_llm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
            elif line.startswith("trio_llm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def shared_prefix_run(fleet: Fleet, args: argparse.Namespace, run: int) -> dict[str, float]:
    """Requests over ``--num-prefixes`` long system prompts (other ones for each ``run``,
    so no run finds the previous one's prefixes cached); the fleet's hit rate."""
    sonnet = (Path(__file__).parent / "data" / "sonnet.txt").read_text().splitlines()
    first = run * args.num_prefixes
    prefixes = [
        f"Poem {i}. " + " ".join(sonnet[(i * 20) % len(sonnet) :][:20])
        for i in range(first, first + args.num_prefixes)
    ]
    before = prefix_hits(fleet)
    limiter = trio.CapacityLimiter(args.clients)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        async with limiter:
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": prefixes[i % len(prefixes)]},
                    {"role": "user", "content": f"Question {i}: what is line {i} about?"},
                ],
                "max_tokens": 2,
            }
            (await http.post("/v1/chat/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(base_url=fleet.router_url, timeout=300) as http:
        async with trio.open_nursery() as nursery:
            for i in range(args.shared_requests):
                nursery.start_soon(one, http, i)
    after = prefix_hits(fleet)
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prompt_tokens": queries, "cached_tokens": hits, "hit_rate": hits / max(queries, 1)}


def report(figures: dict[str, Any]) -> None:
    """Print the figures of every phase."""
    for policy in ("cache_aware", "round_robin"):
        shared = figures[f"shared_prefix_{policy}"]
        print(
            f"shared prefixes, {policy}: fleet prefix-cache hit rate {shared['hit_rate']:.1%} "
            f"({shared['cached_tokens']:.0f} of {shared['prompt_tokens']:.0f} prompt tokens)"
        )
    if "rolling_restart" not in figures:
        return
    rolling, killed = figures["rolling_restart"], figures["sigkill"]
    rows = [
        {"phase": "rolling restart (SIGTERM each)", "ok": rolling["ok"]},
        {"phase": "SIGKILL one replica", "ok": killed["ok"]},
    ]
    rows[0]["failed"], rows[1]["failed"] = rolling["failed"], killed["failed"]
    print_table(rows, ["phase", "ok", "failed"])
    away = ", ".join(f"{seconds:.1f}" for seconds in rolling["seconds_away"])
    print(f"each replica away during the rolling restart: {away} s")
    last = killed["seconds_from_kill_to_last_failure"]
    print(f"SIGKILL: the last failed request ended {last:.2f} s after the kill")
    for reason in rolling["failures"] + killed["failures"]:
        print(f"  failure: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--router", default="vllm-router", help="the router's executable")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--base-port", type=int, default=8300, help="router; replicas after")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    # Odd: with an even count, round robin over 2 replicas would pin each prefix to one.
    parser.add_argument("--num-prefixes", type=int, default=7)
    parser.add_argument("--shared-requests", type=int, default=48)
    parser.add_argument(
        "--prefixes-only", action="store_true", help="skip the restarts: phase (c) only"
    )
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds for each wait")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="replicas-"))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    fleet = Fleet(args, workdir)
    figures: dict[str, Any] = {}
    try:
        for i in range(args.replicas):
            fleet.start_replica(i)
        fleet.start_router("round_robin")
        if not args.prefixes_only:
            rolling = trio.run(under_load, fleet, rolling_restart, body)
            killed = trio.run(under_load, fleet, kill_one, body)
            kill_time = killed.result  # type: ignore[attr-defined]
            last_failure = max((t for t, _ in killed.failures), default=kill_time)
            figures["rolling_restart"] = {
                "ok": rolling.ok,
                "failed": len(rolling.failures),
                "seconds_away": rolling.result,  # type: ignore[attr-defined]
                "failures": [reason for _, reason in rolling.failures[:5]],
            }
            figures["sigkill"] = {
                "ok": killed.ok,
                "failed": len(killed.failures),
                "seconds_from_kill_to_last_failure": last_failure - kill_time,
                "failures": [reason for _, reason in killed.failures[:5]],
            }
        for run, policy in enumerate(("cache_aware", "round_robin")):
            fleet.stop_router()
            fleet.start_router(policy)
            figures[f"shared_prefix_{policy}"] = trio.run(shared_prefix_run, fleet, args, run)
    finally:
        fleet.close()
    report(figures)
    print(f"logs: {workdir}")
    write_json(args.json, figures)
    sys.exit(1 if figures.get("rolling_restart", {}).get("failed") else 0)


if __name__ == "__main__":
    main()
