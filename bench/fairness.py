"""Fairness: what one heavy or careless client costs everyone else (issue 14).

    python bench/fairness.py [--cases prefill,choices,nonreaders] [--long-prompt-len 6000]
        [--n 128] [--ws-clients 200] [--window 20] [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve`` (default flags unless given after ``--``), then for each case:
four *running streams* (short prompts, ``ignore_eos``) decode; the case's load starts; a
short *newcomer* request (8 prompt tokens, 4 output tokens) is sent; and the load ends.

- ``prefill``: one prompt of ``--long-prompt-len`` tokens (``max_tokens`` 1) arrives, and
  the newcomer 1 s after it.
- ``choices``: one request with ``n = --n`` (``max_tokens`` 4000, ``ignore_eos``) runs,
  and the newcomer is sent once n - 4 of its choices have produced a token (the batch is
  full).
- ``payloads``: issue 14's oversized and crafted bodies, one after the other (not in the
  default ``--cases``); per payload its status, how long its answer took, the streams'
  largest gap and the slowest /health answer meanwhile.
- ``nonreaders``: ``--ws-clients`` WebSocket connections each start a long generation and
  never read (4 KiB receive buffers); once /metrics shows them all paused (or after
  ``--pause-wait`` seconds) the newcomer is sent.

Printed per case: the newcomer's time to first token (TTFT) and end-to-end latency; the
largest gap between two tokens of any running stream from the start of the load until
``--window`` seconds after the newcomer finished (or the long prompt's first token, if
later); for ``prefill`` the long prompt's TTFT; for ``nonreaders`` how long the pauses
took and the paused count. Targets on a 2-core CPU (issue 14): newcomer TTFT <= 2 s and
largest gap <= 1.5 s. Figures only; nothing is asserted.

``--pythonpath DIR`` runs the server from another checkout (say, a worktree of an older
commit) for a before/after comparison in one run; start the script from outside the
repository, as ``python -m`` puts the current folder first on the server's path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import parse_server_args, print_table, server_env, write_json
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from tests.support.server_process import ServerProcess

MODEL_FIELD: dict[str, Any] = {}  # the server's default model: no "model" field needed
STREAM_PROMPT = "Write a long story about a lighthouse keeper."
NEWCOMER_PROMPT = "The capital of France is"


class Streams:
    """Four decoding streams; token arrival times (perf_counter seconds) per stream."""

    def __init__(self, count: int = 4) -> None:
        self.times: list[list[float]] = [[] for _ in range(count)]
        self._all_started = trio.Event()

    async def run(self, client: httpx.AsyncClient, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            for index in range(len(self.times)):
                nursery.start_soon(self._one, client, index)
            await self._all_started.wait()
            task_status.started()

    async def _one(self, client: httpx.AsyncClient, index: int) -> None:
        body = {
            "prompt": f"{STREAM_PROMPT} ({index})",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.8,
            "seed": index,
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    self.times[index].append(time.perf_counter())
                    if min(len(t) for t in self.times) >= 3:
                        self._all_started.set()

    def largest_gap(self, start: float, end: float) -> float:
        """Largest time between two tokens (or from ``start`` to the first token after it)
        of any stream, within [start, end]."""
        largest = 0.0
        for times in self.times:
            previous = start
            for t in times:
                if t <= start:
                    continue
                if t > end:
                    largest = max(largest, end - previous) if previous < end else largest
                    break
                largest = max(largest, t - previous)
                previous = t
            else:
                largest = max(largest, end - previous)
        return largest


#: Seconds the newcomer waits at most (``--newcomer-timeout``); set by `main`.
NEWCOMER_TIMEOUT = 120.0


async def newcomer(client: httpx.AsyncClient) -> dict[str, float]:
    """Send the short request; its TTFT and latency in seconds (``inf`` when it got no
    token, or did not finish, within `NEWCOMER_TIMEOUT` seconds)."""
    body = {"prompt": NEWCOMER_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    first = done = None
    with trio.move_on_after(NEWCOMER_TIMEOUT):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter()
        done = time.perf_counter()
    inf = float("inf")
    return {
        "sent": sent,
        "ttft": inf if first is None else first - sent,
        "latency": inf if done is None else done - sent,
        "done": time.perf_counter() if done is None else done,
    }


async def metric(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"trio_llm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def case_prefill(client: httpx.AsyncClient, streams: Streams, args: argparse.Namespace):
    prompt = [1000 + (i % 40000) for i in range(args.long_prompt_len)]
    result: dict[str, Any] = {}
    start = time.perf_counter()

    async def long_request() -> None:
        body = {"prompt": prompt, "max_tokens": 1, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and "long_ttft" not in result:
                    result["long_ttft"] = time.perf_counter() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_request)
        await trio.sleep(1.0)
        result["newcomer"] = await newcomer(client)
    end = max(result["newcomer"]["done"], start + result.get("long_ttft", 0.0)) + args.window
    await trio.sleep(max(0.0, end - time.perf_counter()))
    result["gap"] = streams.largest_gap(start, end)
    return result


async def case_choices(client: httpx.AsyncClient, streams: Streams, args: argparse.Namespace):
    body = {
        "prompt": "Count:",
        "n": args.n,
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    result: dict[str, Any] = {}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seen: set[int] = set()
        lines = response.aiter_lines()
        # The running streams hold 4 slots: with --max-num-seqs equal to n, the fair share
        # leaves the request n - 4 (and the rest of its choices wait).
        while len(seen) < args.n - len(streams.times):
            line = await anext(lines)
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
        result["batch_full_after"] = time.perf_counter() - start
        result["newcomer"] = await newcomer(client)
        end = result["newcomer"]["done"] + args.window
        async for _ in lines:
            if time.perf_counter() >= end:
                break
    result["gap"] = streams.largest_gap(start, end)
    return result


async def _non_reader(address: tuple[str, int], index: int, ready: trio.MemorySendChannel):
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(address)
    stream = trio.SocketStream(sock)
    connection = WSConnection(ConnectionType.CLIENT)
    host = f"{address[0]}:{address[1]}"
    await stream.send_all(connection.send(Request(host=host, target="/v1/ws")))
    while not any(isinstance(e, AcceptConnection) for e in connection.events()):
        connection.receive_data(await stream.receive_some())
    message = {
        "type": "completion",
        "id": f"g{index}",
        "prompt": f"Tell me everything about the number {index}.",
        "max_tokens": 4000,
        "ignore_eos": True,
        "logprobs": 20,
    }
    await stream.send_all(connection.send(TextMessage(json.dumps(message))))
    await ready.send(index)
    async with stream:
        await trio.sleep_forever()  # never reads


async def case_nonreaders(client: httpx.AsyncClient, streams: Streams, args: argparse.Namespace):
    host, port = str(client.base_url).removeprefix("http://").rstrip("/").rsplit(":", 1)
    result: dict[str, Any] = {}
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        send, receive = trio.open_memory_channel[int](args.ws_clients)
        for index in range(args.ws_clients):
            nursery.start_soon(_non_reader, (host, int(port)), index, send)
        for _ in range(args.ws_clients):
            await receive.receive()
        result["connected_after"] = time.perf_counter() - start
        with trio.move_on_after(args.pause_wait):
            while await metric(client, "num_requests_paused") < args.ws_clients:  # noqa: ASYNC110
                await trio.sleep(0.5)  # /metrics can only be polled
        result["paused"] = await metric(client, "num_requests_paused")
        result["paused_after"] = time.perf_counter() - start
        measure_from = time.perf_counter()
        result["newcomer"] = await newcomer(client)
        end = result["newcomer"]["done"] + args.window
        await trio.sleep(max(0.0, end - time.perf_counter()))
        result["gap_while_loading"] = streams.largest_gap(start, measure_from)
        result["gap"] = streams.largest_gap(measure_from, end)
        nursery.cancel_scope.cancel()
    return result


def hostile_payloads() -> dict[str, tuple[str, bytes]]:
    """Issue 14's large or crafted request bodies (path, body), as a client sends them."""

    def body(data: dict[str, Any]) -> bytes:
        return json.dumps(data, separators=(",", ":")).encode()

    return {
        "1.5 M prompts (7.5 MB)": ("/v1/completions", body({"prompt": ["a"] * 1_500_000})),
        "1.3 M token ids": ("/v1/completions", body({"prompt": [1] * 1_300_000})),
        "250 k messages": (
            "/v1/chat/completions",
            body({"messages": [{"role": "user", "content": "a"}] * 250_000}),
        ),
        "1,000 stops of 2,000 chars": (
            "/v1/completions",
            body({"prompt": "hi", "stop": ["ab" * 1000] * 1000}),
        ),
        "64 stops of 256 chars, streamed": (
            "/v1/completions",
            body(
                {
                    "prompt": "Once upon a time",
                    "max_tokens": 32,
                    "stop": [f"{i:02d}" + "x" * 254 for i in range(64)],
                    "stream": True,
                }
            ),
        ),
        "a chat of 2,048 long messages": (
            "/v1/chat/completions",
            body(
                {
                    "messages": [{"role": "user", "content": "word " * 700}] * 2048,
                    "max_tokens": 1,
                }
            ),
        ),
    }


async def _probe_health(client: httpx.AsyncClient, latencies: list[float]) -> None:
    """Ask /health every 50 ms until cancelled, recording how long each answer took."""
    while True:
        sent = time.perf_counter()
        await client.get("/health")
        latencies.append(time.perf_counter() - sent)
        await trio.sleep(0.05)


async def case_payloads(client: httpx.AsyncClient, streams: Streams, args: argparse.Namespace):
    """Each payload in turn: its answer's time, and what the 4 streams and /health saw
    meanwhile (the event loop is shared by every request)."""
    result: dict[str, Any] = {"payloads": {}}
    for name, (path, data) in hostile_payloads().items():
        health: list[float] = []
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_probe_health, client, health)
            response = await client.post(
                path, content=data, headers={"content-type": "application/json"}
            )
            await response.aread()
            answered = time.perf_counter()
            nursery.cancel_scope.cancel()
        result["payloads"][name] = {
            "status": response.status_code,
            "answer_s": answered - start,
            "largest_gap_s": streams.largest_gap(start, answered),
            "slowest_health_s": max(health, default=0.0),
            "bytes": len(data),
        }
    worst = max(result["payloads"].values(), key=lambda r: r["largest_gap_s"])
    result["gap"] = worst["largest_gap_s"]
    result["newcomer"] = await newcomer(client)
    return result


CASES = {
    "prefill": case_prefill,
    "choices": case_choices,
    "nonreaders": case_nonreaders,
    "payloads": case_payloads,
}


async def run_case(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        streams = Streams()
        async with trio.open_nursery() as nursery:
            await nursery.start(streams.run, client)
            result = await CASES[name](client, streams, args)
            nursery.cancel_scope.cancel()
        # Let the aborts land before the next case.
        with trio.move_on_after(60):
            while await metric(client, "num_requests_running") > 0:  # noqa: ASYNC110
                await trio.sleep(0.2)  # /metrics can only be polled
    return result


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    global NEWCOMER_TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="prefill,choices,nonreaders")
    parser.add_argument("--long-prompt-len", type=int, default=6000)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--ws-clients", type=int, default=200)
    parser.add_argument("--pause-wait", type=float, default=600.0)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--newcomer-timeout", type=float, default=120.0)
    args = parse_server_args(parser)
    NEWCOMER_TIMEOUT = args.newcomer_timeout
    env = server_env(args)
    print(f"CPU: {cpu_model()}; server flags: {args.server_flags or '(defaults)'}", flush=True)
    rows = []
    results: dict[str, Any] = {"cpu": cpu_model(), "flags": args.server_flags, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(args.server_flags, log_path=Path(tmp) / "server.log", env=env)
        with server:
            for name in args.cases.split(","):
                print(f"case {name} ...", flush=True)
                result = trio.run(run_case, server.url, name, args)
                results["cases"][name] = result
                row = {
                    "case": name,
                    "newcomer_ttft_s": result["newcomer"]["ttft"],
                    "newcomer_latency_s": result["newcomer"]["latency"],
                    "largest_gap_s": result["gap"],
                }
                if "long_ttft" in result:
                    row["long_prompt_ttft_s"] = result["long_ttft"]
                if "payloads" in result:
                    table = [{"payload": k, **v} for k, v in result["payloads"].items()]
                    print_table(table, list(table[0]))
                if "paused" in result:
                    row["paused"] = int(result["paused"])
                    row["all_paused_after_s"] = result["paused_after"]
                    row["gap_before_pauses_s"] = result["gap_while_loading"]
                rows.append(row)
                print_table([row], list(row))
    print()
    columns = sorted({key for row in rows for key in row}, key=lambda k: (k != "case", k))
    print_table(rows, columns)
    write_json(args.json, results)
    sys.exit(0)


if __name__ == "__main__":
    main()
