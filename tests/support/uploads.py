"""Uploads written by hand (``POST /v1/files`` as ``multipart/form-data``, chunked), for
the tests and benchmarks that play a hostile client on a raw socket."""

from __future__ import annotations

from collections.abc import Iterable

import trio

#: The boundary of the bodies built here.
BOUNDARY = "b0undary"


def upload_head(boundary: str = BOUNDARY) -> bytes:
    """The request head of a chunked ``POST /v1/files`` with ``boundary``."""
    return (
        b"POST /v1/files HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: multipart/form-data; boundary=" + boundary.encode() + b"\r\n\r\n"
    )


def chunked(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


def part_head(name: str, filename: str | None = None, boundary: str = BOUNDARY) -> bytes:
    """A part's boundary line and headers, up to where its value starts."""
    disposition = f'form-data; name="{name}"'
    if filename is not None:
        disposition += f'; filename="{filename}"'
    return f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()


async def connect(url: str) -> trio.SocketStream:
    """A TCP connection to the server at ``url`` (``http://HOST:PORT``)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def read_to_the_end(stream: trio.SocketStream) -> bytes:
    """What the server sends until it ends the connection (a reset after its answer
    ends it too: what came before it has been read)."""
    received = b""
    try:
        while data := await stream.receive_some(65536):
            received += data
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    return received


async def send_chunks(stream: trio.SocketStream, chunks: Iterable[bytes]) -> None:
    """Send each of ``chunks`` as a chunk, for as long as the server's socket takes them."""
    try:
        for chunk in chunks:
            await stream.send_all(chunked(chunk))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
