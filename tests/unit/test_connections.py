"""Cutting the client connections of a port (the shutdown's last resort for clients that
stopped reading): only connected sockets of that port, never the listener."""

from __future__ import annotations

import socket

from trio_llm.connections import shutdown_client_connections


def test_shuts_down_connections_of_the_port_only() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_server(("127.0.0.1", 0)) as other_listener,
    ):
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        other_client = socket.create_connection(other_listener.getsockname())
        other_served, _ = other_listener.accept()
        with client, served, other_client, other_served:
            # The server side stopped being written to by a client that does not read;
            # after the cut the peer sees end-of-file and the server side cannot send.
            assert shutdown_client_connections(port) == 1
            assert client.recv(1) == b""
            try:
                served.send(b"x")
            except OSError:
                pass
            else:
                raise AssertionError("the cut socket still accepts writes")
            # The listener still accepts, and the other port's connection is untouched.
            with socket.create_connection(("127.0.0.1", port)) as again:
                accepted, _ = listener.accept()
                accepted.close()
                again.close()
            other_served.sendall(b"ok")
            assert other_client.recv(2) == b"ok"
