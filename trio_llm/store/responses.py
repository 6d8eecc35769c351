"""Stored responses (``POST /v1/responses`` with ``store``): units of work on the
``responses`` table.

A `StoredResponse` keeps what OpenAI keeps of a response: the response object as it was
returned (``body``), the request's known fields as sent (``request``: enough to run a background
response again after a restart) and the items the response was generated from
(``context``: the earlier context of a ``previous_response_id`` or a conversation, then
the request's own input items, each with an ``id``; what ``input_items`` lists). A
background response is written ``queued``, then ``in_progress``, then once more when it
ends; `update` only changes a response still in one of the active statuses, so a
response that was cancelled (or deleted) meanwhile stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

from trio_llm.store.database import Row, Transaction
from trio_llm.store.objects import Page, dumps, loads, missing, page_after, row_of
from trio_llm.store.retention import ACTIVE_RESPONSE
from trio_llm.store.runners import Runner, live, runner_is

#: `update`'s default: the runner the response names.
SAME = object()

_COLUMNS = (
    "id, created_at, status, background, model, previous_response_id, conversation_id, "
    "request, context, body, runner"
)


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        id: ``resp_...``.
        body: the response object as returned (its ``status`` is the stored status).
        request: the request body's known fields as sent (its unknown fields are not
            kept: `trio_llm.api.request_body.known_fields`).
        context: the items the response was generated from, oldest first, each with an
            ``id``.
        resumed: how many times a server started this background response again after
            another stopped during it.
        runner: the id of the server that runs this background response
            (`trio_llm.store.runners`); None for one that is not a background response.
    """

    id: str
    body: dict[str, Any]
    request: dict[str, Any]
    context: list[dict[str, Any]]
    resumed: int = 0
    runner: str | None = None

    @property
    def status(self) -> str:
        """``queued``, ``in_progress``, ``completed``, ``incomplete``, ``failed`` or
        ``cancelled``."""
        return str(self.body["status"])

    @property
    def background(self) -> bool:
        """Whether the response was created with ``background: true``."""
        return bool(self.body.get("background"))

    @property
    def active(self) -> bool:
        """Whether the response is still queued or being generated."""
        return self.status in ACTIVE_RESPONSE

    @property
    def conversation_id(self) -> str | None:
        """The conversation the response belongs to, or None."""
        conversation = self.body.get("conversation")
        return conversation.get("id") if isinstance(conversation, dict) else None

    def continuation(self) -> list[dict[str, Any]]:
        """The context a response continuing this one starts from: this one's context,
        then its output items."""
        return [*self.context, *self.body.get("output", [])]

    def with_body(self, body: dict[str, Any]) -> StoredResponse:
        """This response with another response object (a new status)."""
        return replace(self, body=body)


def _request_column(response: StoredResponse) -> str:
    return dumps({"body": response.request, "resumed": response.resumed})


def _from_row(row: Row) -> StoredResponse:
    request = loads(row[7])
    return StoredResponse(
        id=str(row[0]),
        body=loads(row[9]),
        request=request["body"],
        context=loads(row[8]),
        resumed=int(request.get("resumed", 0)),
        runner=None if row[10] is None else str(row[10]),
    )


def insert(tx: Transaction, response: StoredResponse) -> None:
    """Store a new response."""
    body = response.body
    request, context, text = _request_column(response), dumps(response.context), dumps(body)
    tx.execute(
        f"INSERT INTO responses ({_COLUMNS}, nbytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            response.id,
            int(body["created_at"]),
            response.status,
            int(response.background),
            str(body.get("model", "")),
            body.get("previous_response_id"),
            response.conversation_id,
            request,
            context,
            text,
            response.runner,
            _nbytes(request, context, text),
        ),
    )


def get(tx: Transaction, response_id: str) -> StoredResponse:
    """The stored response ``response_id``.

    Raises:
        NotFound: no such response (`Evicted` where the retention removed it).
    """
    sql = f"SELECT {_COLUMNS} FROM responses WHERE id = ?"
    return _from_row(row_of(tx, "response", sql, response_id))


def update(
    tx: Transaction, response: StoredResponse, taking_over_from: str | object | None = SAME
) -> bool:
    """Write ``response``'s body (and status), resume count and runner over the stored
    one, if that is still queued or in progress and still run by ``response.runner`` (or
    by ``taking_over_from``, when given: a compare-and-set that takes a gone server's
    response over); False (nothing written) otherwise: it ended, was cancelled, deleted
    or taken over meanwhile."""
    marks = ",".join("?" * len(ACTIVE_RESPONSE))
    request, text = _request_column(response), dumps(response.body)
    row = tx.one("SELECT LENGTH(context) FROM responses WHERE id = ?", (response.id,))
    context_bytes = int(row[0]) if row is not None else 0
    expected = response.runner if taking_over_from is SAME else taking_over_from
    runner_sql, runner_args = runner_is(cast("str | None", expected))
    changed = tx.execute(
        f"UPDATE responses SET status = ?, body = ?, request = ?, nbytes = ?, runner = ? "
        f"WHERE id = ? AND status IN ({marks}) AND {runner_sql}",
        (
            response.status,
            text,
            request,
            len(request.encode()) + context_bytes + len(text.encode()),
            response.runner,
            response.id,
            *ACTIVE_RESPONSE,
            *runner_args,
        ),
    )
    return changed > 0


def delete(tx: Transaction, response_id: str) -> None:
    """Delete a stored response.

    Raises:
        NotFound: no such response (`Evicted` where the retention removed it).
    """
    if tx.execute("DELETE FROM responses WHERE id = ?", (response_id,)) == 0:
        raise missing(tx, "response", response_id)


def input_items(
    tx: Transaction, response_id: str, after: str | None, limit: int, order: str
) -> Page:
    """One page of a response's context items (`objects.page_after`).

    Raises:
        NotFound: no such response, or ``after`` names none of its items (kind ``item``).
    """
    return page_after(get(tx, response_id).context, after, limit, order)


def unfinished(tx: Transaction, me: Runner) -> list[StoredResponse]:
    """The background responses still queued or in progress that no running server runs
    (those a stopped server left), oldest first; ``me`` is this server."""
    marks = ",".join("?" * len(ACTIVE_RESPONSE))
    rows = tx.rows(
        f"SELECT {_COLUMNS} FROM responses WHERE background = 1 AND status IN ({marks}) "
        "ORDER BY created_at, id",
        ACTIVE_RESPONSE,
    )
    running = live(tx, me)
    left = [_from_row(row) for row in rows]
    return [response for response in left if response.runner not in running]


def _nbytes(*texts: str) -> int:
    return sum(len(text.encode()) for text in texts)
