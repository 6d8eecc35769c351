"""Which lane an HTTP request runs in: interactive (every client's), or the batch lane;
and which engine of ``--data-parallel-size N`` serves it, when the client says so.

Batch-lane requests are background work: the engine ranks them after every interactive
request and, while interactive requests wait, lets them hold at most
``--max-batch-share`` of the batch (`trio_llm.messages.Scheduling.batch`). A client
cannot ask for it over HTTP: an in-process caller (the batch runner) calls the ASGI app
directly with ``scope[LANE_SCOPE_KEY] = BATCH_LANE``, and every engine request of that
API request (each choice, each prompt) goes in the batch lane::

    scope = {"type": "http", ..., LANE_SCOPE_KEY: BATCH_LANE}
    await app(scope, receive, send)

A client (or a router in front of the server, as with vLLM) can send a request to one
engine of ``-dp N`` with vLLM's ``X-data-parallel-rank`` header (`data_parallel_rank_of`).

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


#: vLLM's header naming the engine of ``-dp N`` a request goes to (any letter case).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


def data_parallel_rank_of(headers: Mapping[str, str], num_engines: int) -> int | None:
    """The engine rank a request's ``headers`` ask for (`DATA_PARALLEL_RANK_HEADER`), or
    None when they name none.

    Args:
        headers: the request's headers, looked up case-insensitively (Starlette's).
        num_engines: the engines serving the model (``--data-parallel-size``).

    Raises:
        ValueError: the header is not an integer in ``[0, num_engines)`` (the message
            names it; answered as a 400).
    """
    value = headers.get(DATA_PARALLEL_RANK_HEADER)
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit() or int(text) >= num_engines:
        raise ValueError(
            f"the {DATA_PARALLEL_RANK_HEADER} header must be an engine rank in "
            f"[0, {num_engines}) (this model runs {num_engines} engine(s)), got {value[:40]!r}"
        )
    return int(text)
