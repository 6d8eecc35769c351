"""One line of a batch: its input (``{"custom_id", "method", "url", "body"}``), running it
through the server's own request path, and its line of the output or error file.

A line runs as the same HTTP request would, through the ASGI app itself (`call_app`): the
same middleware, parsing, plan, engine and format, so its result is the body the same
request sent online would get. The call is marked as batch work in its scope
(`LANE_SCOPE_KEY`), so the generation routes can schedule it below interactive requests.

Output-file lines are OpenAI's: ``{"id": "batch_req_...", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}``; a line that could not be run has
``"response": null`` and ``"error": {"code", "message"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from starlette.types import ASGIApp, Message

from trio_llm.api.http.lanes import BATCH_LANE, LANE_SCOPE_KEY
from trio_llm.store.objects import dumps, new_id

#: The fields of an input line (OpenAI's batch input format).
LINE_FIELDS = ("custom_id", "method", "url", "body")
#: Most lines in one batch (OpenAI's limit).
MAX_BATCH_LINES = 50_000
#: Most per-line errors a failed batch lists.
MAX_LISTED_ERRORS = 1_000
#: Input lines read per trip to a worker thread.
_LINES_PER_READ = 512


@dataclass(frozen=True)
class LineRequest:
    """A line that can run: its index among the input's lines (0-based, blank lines not
    counted), ``custom_id``, ``url`` (the endpoint's path) and JSON ``body``."""

    index: int
    custom_id: str
    url: str
    body: bytes


@dataclass(frozen=True)
class LineError:
    """A line that cannot run (its output is an ``error`` object): ``code`` and
    ``message`` as OpenAI's error-file lines have them; ``param`` names the line's
    field at fault, if one is."""

    index: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None


def parse_line(index: int, raw: bytes, endpoints: tuple[str, ...]) -> LineRequest | LineError:
    """Read input line ``index`` of a batch whose lines may go to ``endpoints`` (a
    batch's one endpoint; any for ``trio-llm run-batch``): a `LineRequest`, or a
    `LineError` (not JSON, an unknown or missing field, another method or url, a body
    that is not an object or asks for a stream)."""
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):
        return LineError(index, None, "invalid_json", f"line {index + 1} is not valid JSON")
    if not isinstance(line, dict):
        return LineError(index, None, "invalid_request", f"line {index + 1} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = f"line {index + 1}: custom_id must be a non-empty string"
        return LineError(index, None, "invalid_request", message, "custom_id")
    unknown = [key for key in line if key not in LINE_FIELDS]
    if unknown:
        message = f"line {index + 1}: unknown field {unknown[0]!r} (a line has {LINE_FIELDS})"
        return LineError(index, custom_id, "invalid_request", message, unknown[0])
    if line.get("method") != "POST":
        message = f"line {index + 1}: method must be 'POST', not {line.get('method')!r}"
        return LineError(index, custom_id, "invalid_method", message, "method")
    url = line.get("url")
    if url not in endpoints:
        allowed = repr(endpoints[0]) if len(endpoints) == 1 else f"one of {endpoints}"
        message = f"line {index + 1}: url {url!r} is not {allowed}"
        return LineError(index, custom_id, "invalid_url", message, "url")
    body = line.get("body")
    if not isinstance(body, dict):
        message = f"line {index + 1}: body must be a JSON object"
        return LineError(index, custom_id, "invalid_request", message, "body")
    if body.get("stream") is True:
        message = f"line {index + 1}: body.stream: a batch line cannot be streamed"
        return LineError(index, custom_id, "invalid_request", message, "body.stream")
    try:
        # ASCII JSON: a lone surrogate stays an escape, for the request path to refuse.
        text = json.dumps(body)
    except RecursionError:
        message = f"line {index + 1}: body is nested too deeply"
        return LineError(index, custom_id, "invalid_request", message, "body")
    return LineRequest(index, custom_id, str(url), text.encode())


def _read_lines(handle: Any, count: int) -> list[bytes]:
    lines = []
    for _ in range(count):
        raw = handle.readline()
        if not raw:
            break
        lines.append(raw)
    return lines


class InputLines:
    """The non-blank lines of a batch's input file, read a chunk at a time in worker
    threads (a large input is never held whole). Use as an async context manager.

    Args:
        path: the input file's contents.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None
        self._index = 0

    async def __aenter__(self) -> InputLines:
        self._handle = await trio.to_thread.run_sync(self.path.open, "rb")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._handle.close()

    async def next_chunk(self) -> list[tuple[int, bytes]]:
        """The next lines as ``(index, raw)``; empty at the end of the file."""
        while True:
            raws = await trio.to_thread.run_sync(_read_lines, self._handle, _LINES_PER_READ)
            if not raws:
                return []
            chunk = []
            for raw in raws:
                if raw.strip():
                    chunk.append((self._index, raw))
                    self._index += 1
            if chunk:
                return chunk


def check_input(path: Path) -> tuple[int, list[dict[str, Any]]]:
    """What makes a whole input file unusable (blocking): no line, more than
    `MAX_BATCH_LINES`, or a ``custom_id`` used twice (OpenAI refuses duplicates).

    Returns:
        The number of lines, and the errors (``{code, message, param, line}`` each, at
        most `MAX_LISTED_ERRORS`; empty when the file is usable).
    """
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    total = 0
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            total += 1
            try:
                line = json.loads(raw)
            except (ValueError, RecursionError):
                continue  # the line's own error, in the error file
            custom_id = line.get("custom_id") if isinstance(line, dict) else None
            if not isinstance(custom_id, str):
                continue
            if custom_id in seen and len(errors) < MAX_LISTED_ERRORS:
                message = (
                    f"the custom_id {custom_id!r} of line {total} is also the one of line "
                    f"{seen[custom_id]}; each line needs its own"
                )
                errors.append(_file_error("duplicate_custom_id", message, "custom_id", total))
            seen.setdefault(custom_id, total)
    if total == 0:
        errors.append(_file_error("empty_file", "the input file has no request lines", None, None))
    elif total > MAX_BATCH_LINES:
        message = f"the input file has {total} lines; a batch has at most {MAX_BATCH_LINES}"
        errors.append(_file_error("too_many_requests", message, None, None))
    return total, errors


def _file_error(code: str, message: str, param: str | None, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass(frozen=True)
class AppAnswer:
    """What the app answered a line: HTTP status and body bytes."""

    status: int
    body: bytes


def json_post_scope(
    path: str,
    headers: Mapping[str, str] | None = None,
    *,
    host: str,
    client: tuple[str, int] | None = None,
    server: tuple[str, int | None] | None = None,
) -> dict[str, Any]:
    """The ASGI scope of an HTTP/1.1 ``POST path`` with a JSON body to ``host``, with more
    request ``headers``, from ``client`` to ``server`` (None: not a socket)."""
    all_headers = [(b"content-type", b"application/json"), (b"host", host.encode())]
    all_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": all_headers,
        "client": client,
        "server": server,
        "state": {},
    }


async def call_app(
    app: ASGIApp,
    path: str,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    leave: trio.Event | None = None,
) -> AppAnswer:
    """``POST path`` with a JSON ``body`` to the ASGI ``app`` in this process, marked as
    batch work (`LANE_SCOPE_KEY`); return its status and whole body.

    Args:
        headers: more request headers (the API key).
        leave: once set, the "client" disconnects (the handler aborts the request's
            engine work and the call returns what the app answered, if anything).
    """
    leave = trio.Event() if leave is None else leave
    scope = json_post_scope(path, headers, host="batch")
    scope[LANE_SCOPE_KEY] = BATCH_LANE
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return AppAnswer(status, b"".join(chunks))


def answer_line(request: LineRequest, answer: AppAnswer) -> tuple[bool, str]:
    """The output-file line of a line the app answered, and whether it is a success
    (2xx: the output file; else the error file)."""
    try:
        body: Any = json.loads(answer.body)
    except ValueError:
        body = answer.body.decode("utf-8", "replace")
    line = {
        "id": new_id("batch_req_"),
        "custom_id": request.custom_id,
        "response": {"status_code": answer.status, "request_id": new_id("req_"), "body": body},
        "error": None,
    }
    return 200 <= answer.status < 300, dumps(line)


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """The error-file line of a line that was not answered (`LineError`, an expired
    batch)."""
    line = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return dumps(line)
