"""Cutting client connections that a graceful shutdown cannot end by itself.

hypercorn writes to a client inside a cancel-shielded scope, so a handler whose client
stopped reading (its TCP window is full) waits for that client forever, and so would the
shutdown. After the drain deadline and a last grace for error events, the supervisor shuts
such sockets down in the kernel (``shutdown(SHUT_RDWR)``): the blocked write fails at once
with a broken pipe, hypercorn ends the connection, and the process can exit.
"""

from __future__ import annotations

import os
import socket


def shutdown_client_connections(port: int) -> int:
    """Shut down, in both directions, every connected TCP socket of this process whose
    local port is ``port`` (the listening socket itself is left alone).

    Linux only (it walks ``/proc/self/fd``); elsewhere it does nothing.

    Returns:
        the number of connections shut down.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except FileNotFoundError:
        return 0
    count = 0
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not a socket Python can wrap
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
                    continue
                if sock.getsockname()[1] != port:
                    continue
                sock.getpeername()  # OSError (not connected) for the listening socket
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
            count += 1
    return count
