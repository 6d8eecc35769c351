"""A request answered before its body has all arrived, over a real socket: the app (the
files routes, no engine) runs in-process under hypercorn with the server's connection
guard (`trio_llm.api.http.connection_guard`, `trio_llm.api.http.early_answer`). The client keeps
sending; it must see the answer, then the end of the connection, while it still sends
(it used to block until its own timeout: the connection was neither read nor closed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import hypercorn.trio
import pytest
import trio

from tests.support.uploads import chunked, part_head, read_to_the_end, send_chunks, upload_head
from tests.unit.api.batch.test_upload_limits import upload_app
from trio_llm.api.http import connection_guard
from trio_llm.server.supervisor import _hypercorn_config
from trio_llm.server_config import ServerConfig
from trio_llm.store import Store

#: How long a client may wait for the end of the connection before the test calls it a
#: hang (a guard against hanging for ever, not a measurement: it takes milliseconds).
HANG = 30.0
CHUNK = 64 * 1024


@asynccontextmanager
async def serving(store: Store) -> AsyncIterator[tuple[str, int]]:
    """The files app under hypercorn on a free port, as `trio-llm serve` runs it."""
    connection_guard.install()
    config = _hypercorn_config(ServerConfig(port=0))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = partial(hypercorn.trio.serve, upload_app(store), config, shutdown_trigger=stop.wait)
        binds = await nursery.start(serve)
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        yield host, int(port)
        stop.set()
        nursery.cancel_scope.cancel()


#: Requests answered before their bodies end: an upload past --max-file-size, one with a
#: field it does not take, and a body sent to a route that takes none.
EARLY_ANSWERS = {
    "a file past its limit": (upload_head() + chunked(part_head("file", "a")), b"413"),
    "a field the upload does not take": (upload_head() + chunked(part_head("other")), b"400"),
    "a body to a route that takes none": (
        b"POST /v1/files/x HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"405",
    ),
}


@pytest.mark.parametrize(("head", "status"), EARLY_ANSWERS.values(), ids=EARLY_ANSWERS.keys())
async def test_a_client_still_sending_gets_the_answer_then_the_end_of_the_connection(
    store: Store, head: bytes, status: bytes
) -> None:
    endless = (b"x" * CHUNK for _ in range(1_000_000))
    async with serving(store) as (host, port):
        stream = await trio.open_tcp_stream(host, port)
        with trio.fail_after(HANG):
            async with stream, trio.open_nursery() as nursery:
                await stream.send_all(head)
                nursery.start_soon(send_chunks, stream, endless)
                received = await read_to_the_end(stream)
                # The nursery waits for the sender: its sends fail once the server,
                # having drained what it bounds, closes the socket.
    assert received.startswith(b"HTTP/1.1 " + status), received
    assert list(store.files_dir.iterdir()) == []
