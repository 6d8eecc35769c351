"""Load for chaos trials: clients that send streaming and non-streaming HTTP requests
and WebSocket generations (and leave early) until told to stop, each request's end
recorded as a `Record`; a burst of requests at once; one normal request."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import trio

from trio_llm.client import ConnectionClosedError, GenerationError, open_ws_client

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The second model of a server of two (the "sigkill-engine-two-models" trial): an
#: embedding model, asked by the "embed" clients.
SECOND_MODEL = "second"

#: Seconds a request waits for a restarting engine before its 503 (--engine-restart-wait).
RESTART_WAIT = 20.0

#: Any request must end within this many seconds of being sent (waiting for a restarted
#: engine included).
REQUEST_LIMIT = RESTART_WAIT + 25.0

#: A restarted engine must serve again within this many seconds of the fault.
RESTART_DEADLINE = 60.0


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


class Load:
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
                if kind == "embed":
                    body = {"model": SECOND_MODEL, "input": [prompt] * (1 + max_tokens // 8)}
                    response = await client.post(
                        "/v1/embeddings", json=body, extensions={"trace": trace}
                    )
                    if response.status_code == 200:
                        return "complete", ""
                    return _http_error(response)
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


async def normal_request(url: str, *, embedding: bool = False) -> bool:
    """One short request (with ``embedding``, to `SECOND_MODEL`); True if it completed."""
    body: dict[str, object] = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    path = "/v1/completions"
    if embedding:
        body, path = {"model": SECOND_MODEL, "input": "Hello"}, "/v1/embeddings"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=RESTART_DEADLINE) as client:
            response = await client.post(path, json=body)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def burst(url: str, count: int) -> list[Record]:
    """``count`` short non-streaming requests at once (past the waiting limit)."""
    load = Load(url, random.Random(count))
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
