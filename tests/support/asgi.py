"""Driving the ASGI app by hand (for a test that plays the client's receive and send
itself: a client that leaves, or the arrival time of each event)."""

from __future__ import annotations

from typing import Any


def json_post_scope(path: str) -> dict[str, Any]:
    """The ASGI scope of an HTTP/1.1 ``POST path`` with a JSON body, from a client on
    127.0.0.1 to the host ``test``."""
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
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }
