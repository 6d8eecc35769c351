"""Faults on the server's state, under load (issue 41's hostile probe, `STATE_FAULTS`):

- ``batch-poisoned-line``: a batch whose lines include poison (a lone surrogate in a
  ``custom_id`` and in a prompt, a line that is not JSON, a body nested too deeply): the
  batch completes, every ``custom_id`` has exactly one result, the good lines succeed.
- ``background-flood``: background responses sent as fast as possible by a client that
  then leaves; each is accepted or refused at once (429), and a newcomer's streamed chat
  gets its first token in time (background work yields to interactive work).
- ``conversation-deleted-background``: the conversation of a running background
  response is deleted; the response ends (``failed``, or ``completed`` when it finished
  first) in time, never stays ``in_progress``.
- ``slow-upload``: uploads that drip a byte at a time; the server ends each within its
  upload deadline, and leaves no ``.partial`` file (the trial's descriptor check then
  shows none leaked).
- ``oversized-upload``: a chunked upload past ``--max-file-size``; the client gets its
  413 and the connection ends while it still sends.

Each server of these trials has its own store in the trial's folder (`state_server_args`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from tests.support.batches import completion_lines, jsonl
from tests.support.load import MODEL

if TYPE_CHECKING:
    from tests.support.chaos import TrialResult

#: The state fault kinds (also in `tests.support.faults.FAULTS`).
STATE_FAULTS = (
    "batch-poisoned-line",
    "background-flood",
    "conversation-deleted-background",
    "slow-upload",
    "oversized-upload",
)

#: The upload limits of a state trial's server: bytes of a file, seconds a body may stall,
#: the least average rate of an upload (bytes/s): its deadline is ``BODY_STALL_SECONDS +
#: received / UPLOAD_MIN_RATE`` seconds, a few seconds for a drip of a byte a second.
MAX_FILE_BYTES = 1 << 20
BODY_STALL_SECONDS = 2.0
UPLOAD_MIN_RATE = 4096
#: Background responses the flood sends; most may be queued at once on the trial's server.
FLOOD = 40
MAX_BACKGROUND = 12
#: Seconds within which: a batch ends; a flooded server gives a newcomer its first token;
#: a background response ends after its conversation is deleted; the server ends a slow or
#: oversized upload (past its own deadline).
BATCH_DEADLINE = 180.0
NEWCOMER_DEADLINE = 20.0
BACKGROUND_END_DEADLINE = 90.0
UPLOAD_END_DEADLINE = 10.0


def state_server_args(folder: Path) -> list[str]:
    """The flags of a state trial's server: a store of its own in ``folder``, small
    upload limits and a small background queue."""
    return [
        "--store-url",
        f"sqlite:///{folder}/store.db",
        "--max-file-size",
        str(MAX_FILE_BYTES),
        "--request-body-timeout",
        f"{BODY_STALL_SECONDS:g}",
        "--upload-min-rate",
        str(UPLOAD_MIN_RATE),
        "--max-background-responses",
        str(MAX_BACKGROUND),
    ]


async def inject_state_fault(fault: str, url: str, folder: Path, result: TrialResult) -> None:
    """Inject ``fault`` (`STATE_FAULTS`) into the server at ``url`` whose store is in
    ``folder``; what went wrong is appended to ``result.failures``."""
    inject = {
        "batch-poisoned-line": _poisoned_batch,
        "background-flood": _background_flood,
        "conversation-deleted-background": _conversation_deleted,
        "slow-upload": _slow_uploads,
        "oversized-upload": _oversized_upload,
    }[fault]
    try:
        await inject(url, folder, result)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
        result.failures.append(f"{fault}: {exc!r}")


# ------------------------------------------------------------------ a poisoned batch


#: Raw input lines that poison a batch, by the custom_id their result must carry (None:
#: the line has none to echo), and whether the line succeeds.
def _poison_lines() -> list[tuple[str, str | None, bool]]:
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    deep = "[" * 20_000 + "]" * 20_000
    return [
        (json.dumps(_line("bad\ud800id", good)), "bad\ud800id", True),
        (json.dumps(_line("surrogate-prompt", good | {"prompt": "a\udc00b"})), None, False),
        ('{"custom_id": "not-json", "method": "POST", "url": ', None, False),
        (
            '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", '
            f'"body": {{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 2, "x": {deep}}}}}',
            None,
            False,
        ),
    ]


def _line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


async def _poisoned_batch(url: str, folder: Path, result: TrialResult) -> None:
    good = completion_lines(5, 4, prefix="good")
    poison = _poison_lines()
    data = jsonl([*good[:3], *(raw for raw, _, _ in poison), *good[3:]])
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        upload = await client.post(
            "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
        )
        upload.raise_for_status()
        created = await client.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch = await _poll(client, f"/v1/batches/{created.json()['id']}", BATCH_DEADLINE)
        if batch is None:
            result.failures.append(f"poisoned batch: not over within {BATCH_DEADLINE:g} s")
            return
        if batch["status"] != "completed":
            result.failures.append(f"poisoned batch ended {batch['status']}: {batch['errors']}")
            return
        outputs = await _file_lines(client, batch.get("output_file_id"))
        errors = await _file_lines(client, batch.get("error_file_id"))
    total = len(good) + len(poison)
    succeeded = {line["custom_id"] for line in outputs}
    wanted = {line["custom_id"] for line in good} | {c for _, c, ok in poison if ok and c}
    counts = batch["request_counts"]
    if succeeded != wanted:
        result.failures.append(f"poisoned batch: succeeded {succeeded}, expected {wanted}")
    if len(outputs) + len(errors) != total or counts != {
        "total": total,
        "completed": len(wanted),
        "failed": total - len(wanted),
    }:
        result.failures.append(
            f"poisoned batch: {len(outputs)} output and {len(errors)} error lines, "
            f"request_counts {counts}, for {total} lines"
        )


async def _file_lines(client: httpx.AsyncClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = await client.get(f"/v1/files/{file_id}/content")
    response.raise_for_status()
    return [json.loads(line) for line in response.content.splitlines() if line.strip()]


async def _poll(client: httpx.AsyncClient, path: str, seconds: float) -> dict[str, Any] | None:
    """GET ``path`` until its ``status`` is over; the object, or None after ``seconds``."""
    over = ("completed", "failed", "expired", "cancelled", "incomplete")
    with trio.move_on_after(seconds):
        while True:
            body = (await client.get(path)).json()
            if body.get("status") in over:
                return body
            # Another process's state: nothing to wait on but its answers.
            await trio.sleep(0.2)
    return None


# ------------------------------------------------------------------ background responses


def _background_body(**more: Any) -> dict[str, Any]:
    body = {"model": MODEL, "input": "Tell a long story.", "background": True}
    return body | {"max_output_tokens": 48, "temperature": 0} | more


async def _background_flood(url: str, folder: Path, result: TrialResult) -> None:
    statuses: list[int] = []

    async def send(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/responses", json=_background_body())
        statuses.append(response.status_code)

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(FLOOD):
                nursery.start_soon(send, client)
    unexpected = [s for s in statuses if s not in (200, 429)]
    if unexpected or len(statuses) != FLOOD:
        result.failures.append(f"background flood: statuses {sorted(statuses)}")
    if statuses.count(200) > MAX_BACKGROUND:
        result.failures.append(
            f"background flood: {statuses.count(200)} accepted, the queue holds {MAX_BACKGROUND}"
        )
    first_token = await _newcomer_first_token(url)
    if first_token is None:
        result.failures.append(
            f"background flood: a newcomer got no first token within {NEWCOMER_DEADLINE:g} s"
        )


async def _newcomer_first_token(url: str) -> float | None:
    """Seconds to the first content of a streamed chat, or None past the deadline."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    began = time.monotonic()
    with trio.move_on_after(NEWCOMER_DEADLINE):
        async with (
            httpx.AsyncClient(base_url=url, timeout=NEWCOMER_DEADLINE) as client,
            client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as reply,
        ):
            async for line in reply.aiter_lines():
                if '"content"' in line:
                    return time.monotonic() - began
    return None


async def _conversation_deleted(url: str, folder: Path, result: TrialResult) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        conversation = (await client.post("/v1/conversations", json={})).json()["id"]
        body = _background_body(conversation=conversation, max_output_tokens=96)
        created = await client.post("/v1/responses", json=body)
        if created.status_code != 200:
            result.failures.append(f"conversation trial: HTTP {created.status_code} {created.text}")
            return
        response_id = created.json()["id"]
        deleted = await client.delete(f"/v1/conversations/{conversation}")
        if deleted.status_code != 200:
            result.failures.append(f"conversation trial: delete answered {deleted.status_code}")
        ended = await _poll(client, f"/v1/responses/{response_id}", BACKGROUND_END_DEADLINE)
    if ended is None:
        result.failures.append(
            f"background response still running {BACKGROUND_END_DEADLINE:g} s after its "
            "conversation was deleted"
        )
    elif ended["status"] not in ("failed", "completed"):
        result.failures.append(f"background response ended {ended['status']}")
    elif ended["status"] == "failed" and not ended.get("error"):
        result.failures.append("background response failed without an error")


# ------------------------------------------------------------------ uploads

SLOW_UPLOADS = 16
_BOUNDARY = "chaosboundary"


def _upload_head(port: int) -> bytes:
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={_BOUNDARY}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_FILE_PART = (
    f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n'
    "Content-Type: application/octet-stream\r\n\r\n"
).encode()


async def _drip(port: int, ended: list[float], began: float) -> None:
    """An upload that sends one byte a second until the server ends it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(_upload_head(port) + _chunk(_FILE_PART))
            async with trio.open_nursery() as nursery:

                async def drip() -> None:
                    while True:
                        await stream.send_all(_chunk(b"x"))
                        await trio.sleep(1.0)

                nursery.start_soon(drip)
                while await stream.receive_some(4096):
                    pass  # the answer (408), then the end of the connection
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed by the server while sending (grouped by the nursery): ended too
    ended.append(time.monotonic() - began)


async def _slow_uploads(url: str, folder: Path, result: TrialResult) -> None:
    port = int(url.rsplit(":", 1)[1])
    ended: list[float] = []
    began = time.monotonic()
    limit = BODY_STALL_SECONDS + 1.0 + UPLOAD_END_DEADLINE
    with trio.move_on_after(limit):
        async with trio.open_nursery() as nursery:
            for _ in range(SLOW_UPLOADS):
                nursery.start_soon(_drip, port, ended, began)
    if len(ended) != SLOW_UPLOADS:
        result.failures.append(
            f"slow uploads: {SLOW_UPLOADS - len(ended)} of {SLOW_UPLOADS} still open "
            f"after {limit:g} s (--request-body-timeout {BODY_STALL_SECONDS:g}, "
            f"--upload-min-rate {UPLOAD_MIN_RATE})"
        )
    partial = list((folder / "files").glob("*.partial")) if (folder / "files").is_dir() else []
    if partial:
        result.failures.append(f"slow uploads left {len(partial)} .partial files")


async def _oversized_upload(url: str, folder: Path, result: TrialResult) -> None:
    port = int(url.rsplit(":", 1)[1])
    answer = b""
    sent = 0
    block = _chunk(b"x" * 65536)
    with trio.move_on_after(UPLOAD_END_DEADLINE) as timer:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                await stream.send_all(_upload_head(port) + _chunk(_FILE_PART))
                async with trio.open_nursery() as nursery:

                    async def flood() -> None:
                        nonlocal sent
                        try:
                            while True:
                                await stream.send_all(block)
                                sent += len(block)
                        except trio.BrokenResourceError:
                            pass  # closed by the server while sending: read its answer

                    nursery.start_soon(flood)
                    while chunk := await stream.receive_some(4096):
                        answer += chunk
                    nursery.cancel_scope.cancel()
            except* (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # reset by the server: what it answered before is in ``answer``
    if timer.cancelled_caught:
        result.failures.append(
            f"oversized upload: the connection was still open {UPLOAD_END_DEADLINE:g} s "
            f"after it started ({sent} bytes sent, answer {answer[:40]!r})"
        )
    elif not answer.startswith(b"HTTP/1.1 413"):
        result.failures.append(f"oversized upload: answered {answer[:60]!r}, expected a 413")
