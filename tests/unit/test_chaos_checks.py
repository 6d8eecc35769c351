"""The chaos trials' own checks (`tests.support.checks`), on sockets of this process."""

from __future__ import annotations

import os
import socket

import trio
import trio.testing

from tests.support.checks import client_connections, settled_fds


async def test_the_descriptor_snapshot_waits_for_a_closed_clients_connection() -> None:
    """A client that closed its connection leaves the server's end open (close-wait)
    until the server closes it: a snapshot taken then counts a descriptor that goes away
    by itself (issue 41, item 15: "16 file descriptors, 17 expected")."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server_end, _ = listener.accept()
        client.close()
        fd = server_end.fileno()
        assert f"fd {fd}: close-wait" in client_connections(os.getpid())
        snapshots: list[dict[int, str]] = []

        async def snapshot() -> None:
            snapshots.append(await settled_fds(os.getpid()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(snapshot)
            await trio.testing.wait_all_tasks_blocked()
            assert snapshots == []  # the server's end is still open
            server_end.close()
        assert fd not in snapshots[0]
        assert listener.fileno() in snapshots[0]  # a listening socket is no connection
