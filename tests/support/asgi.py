"""Driving the ASGI app by hand (for a test that plays the client's receive and send
itself: a client that leaves, or the arrival time of each event)."""

from __future__ import annotations

from typing import Any

from trio_llm.api.batch import lines as batch_lines


def json_post_scope(path: str) -> dict[str, Any]:
    """The ASGI scope of an HTTP/1.1 ``POST path`` with a JSON body, from a client on
    127.0.0.1 to the host ``test`` (the batch runner's scope, with a socket)."""
    return batch_lines.json_post_scope(
        path, host="test", client=("127.0.0.1", 1234), server=("test", 80)
    )
