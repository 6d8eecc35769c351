"""Which lane an HTTP request runs in: interactive (every client's), or the batch lane.

Batch-lane requests are background work: the engine ranks them after every interactive
request and, while interactive requests wait, lets them hold at most
``--max-batch-share`` of the batch (`trio_llm.messages.Scheduling.batch`). A client
cannot ask for it over HTTP: an in-process caller (the batch runner) calls the ASGI app
directly with ``scope[LANE_SCOPE_KEY] = BATCH_LANE``, and every engine request of that
API request (each choice, each prompt) goes in the batch lane::

    scope = {"type": "http", ..., LANE_SCOPE_KEY: BATCH_LANE}
    await app(scope, receive, send)

Data only (this module imports nothing of the server), so such a caller can import it
without the request models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

#: The ASGI scope key naming a request's lane (absent: interactive). Scope keys are not
#: headers: nothing a client sends can set it.
LANE_SCOPE_KEY = "trio_llm.lane"

#: The lanes: `INTERACTIVE_LANE` (the default) and `BATCH_LANE`.
Lane = Literal["interactive", "batch"]
INTERACTIVE_LANE: Lane = "interactive"
BATCH_LANE: Lane = "batch"


def lane_of(scope: Mapping[str, Any]) -> Lane:
    """The lane an ASGI ``scope`` asks for (`LANE_SCOPE_KEY`; absent: interactive).

    Raises:
        ValueError: the key holds something other than a lane's name (a bug of the
            in-process caller that set it, answered as a server error).
    """
    lane = scope.get(LANE_SCOPE_KEY, INTERACTIVE_LANE)
    if lane not in (INTERACTIVE_LANE, BATCH_LANE):
        raise ValueError(
            f"scope[{LANE_SCOPE_KEY!r}] must be {INTERACTIVE_LANE!r} or {BATCH_LANE!r}, "
            f"got {lane!r}"
        )
    return lane
