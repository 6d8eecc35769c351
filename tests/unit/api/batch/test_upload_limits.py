"""The limits of an upload (``POST /v1/files``, `trio_llm.api.batch.file_upload`), played on the
ASGI app without an engine: each limit is answered as soon as it is passed, not when the
body ends (the client's receive counts what the app read), a slow-drip upload is cut by
its deadline (on Trio's autojump clock: no real waiting), a malformed body is a 400 and
never a 500, and a store's folder that went away or refuses writes is no 500 with a path.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.asgi import json_post_scope
from tests.support.uploads import BOUNDARY, part_head
from trio_llm.api.batch.files import MULTIPART_ALLOWANCE, install_file_routes
from trio_llm.api.http.errors import install_error_handlers
from trio_llm.api.http.middleware import install_middleware
from trio_llm.server_config import ServerConfig, StoreConfig
from trio_llm.store import Store
from trio_llm.store.files import FileWriter

MAX_FILE = 256 * 1024
#: The test server's --request-body-timeout (s) and --upload-min-rate (bytes/s).
STALL = 6.0
MIN_RATE = 1024


def upload_app(store: Store | None, **config: Any) -> FastAPI:
    """The files routes with the server's middleware and error handlers, on ``store``."""
    store_config = StoreConfig(max_file_bytes=MAX_FILE, upload_min_rate=MIN_RATE)
    settings_ = {"max_request_body_bytes": 100, "request_body_timeout": STALL, **config}
    server = ServerConfig(store=store_config, **settings_)
    app = FastAPI()
    install_error_handlers(app)
    install_middleware(app, server)
    install_file_routes(app, SimpleNamespace(store=store), server)  # type: ignore[arg-type]
    return app


def field(name: str, value: bytes) -> bytes:
    """A whole form field, with the line end that closes its value."""
    return part_head(name) + value + b"\r\n"


CLOSING = f"--{BOUNDARY}--\r\n".encode()


def whole_upload(data: bytes, purpose: bytes = b"batch") -> bytes:
    """A well-formed upload of ``data``."""
    return field("purpose", purpose) + part_head("file", "a.jsonl") + data + b"\r\n" + CLOSING


@dataclass
class Answer:
    """What the app answered, and how many chunks of the body it had read by then."""

    status: int
    headers: dict[bytes, bytes]
    error: dict[str, Any]
    chunks_read: int


async def post_upload(app: FastAPI, chunks: Iterable[bytes], *, gap: float = 0.0) -> Answer:
    """Play a client that sends ``chunks`` as the body of ``POST /v1/files`` (chunked, one
    chunk ``gap`` seconds after the other), and return the app's answer."""
    scope = json_post_scope("/v1/files")
    content_type = f"multipart/form-data; boundary={BOUNDARY}".encode()
    scope["headers"] = [(b"content-type", content_type), (b"host", b"test")]
    pending: Iterator[bytes] = iter(chunks)
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if gap:
            await trio.sleep(gap)
        chunk = next(pending, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    error = json.loads(body).get("error", {}) if body else {}
    return Answer(sent[0]["status"], dict(sent[0]["headers"]), error, read)


def files_left(store: Store) -> list[str]:
    return sorted(path.name for path in store.files_dir.iterdir())


# ------------------------------------------------------------------ item 6: caps


async def test_a_field_the_upload_does_not_take_is_refused_as_soon_as_its_headers_are_read(
    store: Store,
) -> None:
    """The issue's 100,000 fields: refused at the first, not kept until the body ends."""
    chunks = (b"".join(field(f"f{i}_{j}", b"v") for j in range(500)) for i in range(200))
    answer = await post_upload(upload_app(store), chunks)
    assert answer.status == 400
    assert answer.error["param"] == "f0_0" and "`file` and `purpose`" in answer.error["message"]
    assert answer.chunks_read == 1
    assert files_left(store) == []


@pytest.mark.parametrize("name", ["purpose", "file"])
async def test_a_field_given_twice_is_refused_at_once(store: Store, name: str) -> None:
    first = field("purpose", b"batch") if name == "purpose" else part_head("file", "a") + b"x\r\n"
    second = (field("purpose", b"batch") if name == "purpose" else part_head("file", "b")) * 1000
    answer = await post_upload(upload_app(store), [first, second, b"y" * 1000, CLOSING])
    assert answer.status == 400 and answer.error["param"] == name
    assert answer.chunks_read == 2
    assert files_left(store) == []


CHUNK = 16 * 1024
#: Bodies whose bytes besides the file grow without a bound, chunk after chunk.
ENDLESS_OVERHEAD = {
    "padding after a boundary": lambda: (
        [field("purpose", b"batch") + f"--{BOUNDARY}".encode()] + [b" \t" * (CHUNK // 2)] * 1000
    ),
    "an epilogue after the last boundary": lambda: (
        [whole_upload(b"{}")] + [b"epilogue " * (CHUNK // 9)] * 1000
    ),
    "a preamble of line ends": lambda: [b"\r\n" * (CHUNK // 2)] * 1000,
}


@pytest.mark.parametrize("body", ENDLESS_OVERHEAD.values(), ids=ENDLESS_OVERHEAD.keys())
async def test_the_bytes_besides_the_file_are_capped_and_answered_at_once(
    store: Store, body
) -> None:
    answer = await post_upload(upload_app(store), body())
    assert answer.status == 413, answer.error
    assert answer.error["code"] == "request_too_large"
    assert str(MULTIPART_ALLOWANCE) in answer.error["message"]
    assert answer.headers[b"connection"] == b"close"
    assert answer.chunks_read <= MULTIPART_ALLOWANCE // CHUNK + 2
    assert files_left(store) == []


async def test_a_file_over_its_limit_is_answered_at_once(store: Store) -> None:
    chunks = [part_head("file", "big")] + [b"z" * CHUNK] * 1000
    answer = await post_upload(upload_app(store), chunks)
    assert answer.status == 413 and answer.error["code"] == "file_too_large"
    assert answer.chunks_read <= MAX_FILE // CHUNK + 2
    assert files_left(store) == []


# ------------------------------------------------------------------ item 7: the deadline


async def test_a_slow_drip_upload_gets_a_408_and_leaves_no_partial_file(
    store: Store, autojump_clock: trio.abc.Clock
) -> None:
    """One byte every 3 s, under a per-chunk timeout of 6 s: cut after about 6 s."""
    drip = [part_head("file", "a")] + [b"x"] * 1000
    answer = await post_upload(upload_app(store), drip, gap=3.0)
    assert answer.status == 408, answer.error
    assert answer.error["code"] == "request_timeout"
    assert "--upload-min-rate" in answer.error["message"]
    assert answer.headers[b"connection"] == b"close"
    assert answer.chunks_read <= 4
    assert files_left(store) == []  # the .partial file is gone (and its descriptor closed)


@pytest.mark.parametrize(
    ("chunk_bytes", "stored"),
    [(4 * MIN_RATE, True), (2 * MIN_RATE, False)],
    ids=["faster than the minimum rate", "slower"],
)
async def test_a_long_upload_is_stored_when_it_keeps_the_minimum_rate(
    store: Store, autojump_clock: trio.abc.Clock, chunk_bytes: int, stored: bool
) -> None:
    """A chunk every 3 s for 150 s: 1.33 times the minimum rate is stored, 0.67 is not."""
    data = b"{}\n" * (chunk_bytes // 3)
    chunks = [field("purpose", b"batch") + part_head("file", "a.jsonl")]
    chunks += [data] * 50 + [b"\r\n" + CLOSING]
    answer = await post_upload(upload_app(store), chunks, gap=3.0)
    if stored:
        assert answer.status == 200
        assert len(files_left(store)) == 1
    else:
        assert answer.status == 408 and answer.chunks_read < 20
        assert files_left(store) == []


async def test_a_stall_is_named_as_one(store: Store, autojump_clock: trio.abc.Clock) -> None:
    answer = await post_upload(upload_app(store), [part_head("file", "a"), b"x"], gap=STALL + 1)
    assert answer.status == 408 and "stalled" in answer.error["message"]
    assert "--request-body-timeout" in answer.error["message"]


# ------------------------------------------------------------------ item 13: malformed bodies


async def test_a_boundary_too_long_for_the_parser_is_a_400(store: Store) -> None:
    boundary = "b" * 300
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    transport = httpx.ASGITransport(app=upload_app(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.post(
            "/v1/files",
            content=body + f"--{boundary}--\r\n",
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )
    assert answer.status_code == 400, answer.text
    assert "boundary" in answer.json()["error"]["message"]


_PIECES = st.sampled_from(
    [b"--", b"\r\n", b"\r", b"\n", b":", b";", b"=", b'"', b" ", b"\t", b"\x00", b"\xff", b"-"]
)


@st.composite
def mangled_uploads(draw: st.DrawFn) -> tuple[str, bytes]:
    """A boundary (up to 400 characters) and a well-formed upload with bytes cut, added
    or repeated here and there."""
    boundary = draw(
        st.text("b-_'()+,./:=? ", min_size=1, max_size=400).map(str.strip) | st.just(BOUNDARY)
    )
    body = bytearray(whole_upload(b'{"a": 1}\n').replace(BOUNDARY.encode(), boundary.encode()))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(body)))
        action = draw(st.sampled_from(["cut", "add", "repeat"]))
        if action == "cut":
            del body[at : at + draw(st.integers(1, 8))]
        elif action == "add":
            body[at:at] = draw(st.lists(_PIECES, min_size=1, max_size=4).map(b"".join))
        else:
            body[at:at] = body[draw(st.integers(0, len(body))) :][: draw(st.integers(1, 40))]
    return boundary, bytes(body)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(upload=mangled_uploads())
async def test_no_malformed_upload_is_a_server_error(
    store: Store, upload: tuple[str, bytes]
) -> None:
    boundary, body = upload
    transport = httpx.ASGITransport(app=upload_app(store), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.post(
            "/v1/files",
            content=body,
            headers={"content-type": f'multipart/form-data; boundary="{boundary}"'},
        )
    assert answer.status_code in (200, 400, 413), answer.text
    assert answer.json().get("error", {}).get("type") != "server_error"
    assert not [name for name in files_left(store) if name.endswith(".partial")]


# ------------------------------------------------------------------ item 12: the store's folder


async def test_an_upload_after_the_files_folder_vanished_makes_it_again(store: Store) -> None:
    shutil.rmtree(store.files_dir)
    answer = await post_upload(upload_app(store), [whole_upload(b"{}\n")])
    assert answer.status == 200, answer.error
    assert len(files_left(store)) == 1


async def test_a_folder_that_refuses_writes_is_a_503_without_its_path(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(self: FileWriter, files_dir, file_id, max_bytes=None) -> None:
        path = files_dir / f".{file_id}.partial"
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(FileWriter, "__init__", refused)
    answer = await post_upload(upload_app(store), [whole_upload(b"{}\n")])
    assert answer.status == 503
    assert answer.error["code"] == "store_unavailable"
    assert "Permission denied" in answer.error["message"]
    text = json.dumps(answer.error)
    assert str(store.files_dir) not in text and "Traceback" not in text
