"""Stored responses (``POST /v1/responses`` with ``store``): units of work on the
``responses`` table.

A `StoredResponse` keeps what OpenAI keeps of a response: the response object as it was
returned (``body``), the request's known fields as sent (``request``: enough to run a
background response again after a restart) and the items the response was generated
from (what ``input_items`` lists): the earlier context of a ``previous_response_id`` or a
conversation, then the request's own input items, each with an ``id``.

A context that begins with a conversation's items refers to them (`ContextRef`: the
conversation and the bound its items were read at, `trio_llm.store.conversations`)
instead of copying them, so that the store keeps a conversation's items once however
many responses use it; the rest (``context``) is stored with the response. Rows written
before (schema 2) hold their whole context, and read as they did. ``input_items`` pages
the conversation's part in SQL (`input_items`).

A background response is written ``queued``, then ``in_progress``, then once more when it
ends; `update` only changes a response still in one of the active statuses, so a
response that was cancelled (or deleted) meanwhile stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from trio_llm.store import conversations
from trio_llm.store.database import Row, Transaction
from trio_llm.store.objects import NotFound, Page, dumps, loads, missing, page_after, row_of
from trio_llm.store.retention import ACTIVE_RESPONSE
from trio_llm.store.runners import Runner, live, runner_is

#: `update`'s default: the runner the response names.
SAME = object()

_COLUMNS = (
    "id, created_at, status, background, model, previous_response_id, conversation_id, "
    "request, context, body, runner, context_conversation, context_seq"
)


class ContextRef(NamedTuple):
    """The part of a response's context read from a conversation: its items before
    ``bound`` (`trio_llm.store.conversations.items_before`)."""

    conversation_id: str
    bound: int


class SharedContext(list[dict[str, Any]]):
    """A context (a list of items) whose first ``shared`` items are a conversation's
    (``ref``): a response stored from it refers to those (`StoredResponse.context_ref`)
    and stores the rest."""

    def __init__(self, items: list[dict[str, Any]], ref: ContextRef, shared: int) -> None:
        super().__init__(items)
        self.ref = ref
        self.shared = shared


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        id: ``resp_...``.
        body: the response object as returned (its ``status`` is the stored status).
        request: the request body's known fields as sent (its unknown fields are not
            kept: `trio_llm.api.chat.request_body.known_fields`).
        context: the items the response was generated from that are stored with it,
            oldest first, each with an ``id``: after ``context_ref``'s items, when it
            has one (`whole_context`).
        resumed: how many times a server started this background response again after
            another stopped during it.
        runner: the id of the server that runs this background response
            (`trio_llm.store.runners`); None for one that is not a background response.
        context_ref: the conversation's items the context begins with, read from it
            (not stored with the response); None: ``context`` is the whole context.
    """

    id: str
    body: dict[str, Any]
    request: dict[str, Any]
    context: list[dict[str, Any]]
    resumed: int = 0
    runner: str | None = None
    context_ref: ContextRef | None = None

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
        """The stored part of the context a response continuing this one starts from:
        this one's stored context, then its output items (after ``context_ref``'s
        items: `continuation`)."""
        return [*self.context, *self.body.get("output", [])]

    def with_body(self, body: dict[str, Any]) -> StoredResponse:
        """This response with another response object (a new status)."""
        return replace(self, body=body)


def stored_response(
    response_id: str,
    body: dict[str, Any],
    request: dict[str, Any],
    context: list[dict[str, Any]],
    own: list[dict[str, Any]],
) -> StoredResponse:
    """The `StoredResponse` of a response generated from ``context`` then its ``own``
    input items: referring to a `SharedContext`'s conversation items, copying the rest."""
    if isinstance(context, SharedContext):
        stored = [*context[context.shared :], *own]
        return StoredResponse(response_id, body, request, stored, context_ref=context.ref)
    return StoredResponse(response_id, body, request, [*context, *own])


def _request_column(response: StoredResponse) -> str:
    return dumps({"body": response.request, "resumed": response.resumed})


def _from_row(row: Row) -> StoredResponse:
    request = loads(row[7])
    ref = None if row[11] is None else ContextRef(str(row[11]), int(row[12]))
    return StoredResponse(
        id=str(row[0]),
        body=loads(row[9]),
        request=request["body"],
        context=loads(row[8]),
        resumed=int(request.get("resumed", 0)),
        runner=None if row[10] is None else str(row[10]),
        context_ref=ref,
    )


def insert(tx: Transaction, response: StoredResponse) -> None:
    """Store a new response."""
    body, ref = response.body, response.context_ref
    request, context, text = _request_column(response), dumps(response.context), dumps(body)
    tx.execute(
        f"INSERT INTO responses ({_COLUMNS}, nbytes) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            None if ref is None else ref.conversation_id,
            None if ref is None else ref.bound,
            _nbytes(request, context, text),
        ),
    )


def get(tx: Transaction, response_id: str, *, with_context: bool = True) -> StoredResponse:
    """The stored response ``response_id`` (``with_context=False``: its ``context`` left
    empty, not read).

    Raises:
        NotFound: no such response (`Evicted` where the retention removed it).
    """
    columns = _COLUMNS if with_context else _COLUMNS.replace("context,", "'[]',")
    sql = f"SELECT {columns} FROM responses WHERE id = ?"
    return _from_row(row_of(tx, "response", sql, response_id))


def earlier_context(tx: Transaction, response: StoredResponse) -> list[dict[str, Any]]:
    """The conversation's items ``response``'s context begins with (`ContextRef`); none
    for a response whose context is stored whole."""
    ref = response.context_ref
    if ref is None:
        return []
    return [item for _, item in conversations.items_before(tx, ref.conversation_id, ref.bound)]


def continuation(tx: Transaction, response_id: str) -> tuple[StoredResponse, list[dict[str, Any]]]:
    """The response ``response_id`` and the context a response continuing it starts
    from: its whole context, then its output items (a `SharedContext` where it refers to
    a conversation's items, so the continuation refers to them too).

    Raises:
        NotFound: no such response.
    """
    response = get(tx, response_id)
    earlier = earlier_context(tx, response)
    items = [*earlier, *response.continuation()]
    if response.context_ref is None:
        return response, items
    return response, SharedContext(items, response.context_ref, len(earlier))


def update(
    tx: Transaction, response: StoredResponse, taking_over_from: str | object | None = SAME
) -> bool:
    """Write ``response``'s body (and status), resume count and runner over the stored
    one, if that is still queued or in progress and still run by ``response.runner`` (or
    by ``taking_over_from``, when given: a compare-and-set that takes a gone server's
    response over); False (nothing written) otherwise: it ended, was cancelled, deleted
    or taken over meanwhile. Its context is not written."""
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
    """Delete a stored response (and what a deleted conversation kept only for it:
    `trio_llm.store.conversations.collect`).

    Raises:
        NotFound: no such response (`Evicted` where the retention removed it).
    """
    row = tx.one("SELECT context_conversation FROM responses WHERE id = ?", (response_id,))
    if row is None:
        raise missing(tx, "response", response_id)
    tx.execute("DELETE FROM responses WHERE id = ?", (response_id,))
    if row[0] is not None:
        conversations.collect(tx, str(row[0]))


def input_items(
    tx: Transaction, response_id: str, after: str | None, limit: int, order: str
) -> Page:
    """One page of a response's context items (as `objects.page_after`); the part read
    from a conversation is paged in SQL (a page never reads the whole context).

    Raises:
        NotFound: no such response, or ``after`` names none of its items (kind ``item``).
    """
    response = get(tx, response_id)
    ref = response.context_ref
    if ref is None:
        return page_after(response.context, after, limit, order)
    stored = response.context if order == "asc" else response.context[::-1]
    ids = [item.get("id") for item in stored]
    in_stored = after is not None and after in ids
    seq = None
    if after is not None and not in_stored:
        seq = conversations.seq_before(tx, ref.conversation_id, ref.bound, after)
        if seq is None:
            raise NotFound("item", after)
    found: list[dict[str, Any]] = []

    def read_conversation(count: int) -> None:
        rows = conversations.items_before(
            tx, ref.conversation_id, ref.bound, after_seq=seq, limit=count, order=order
        )
        found.extend(item for _, item in rows)

    start = ids.index(after) + 1 if in_stored else 0
    if order == "asc" and not in_stored:  # the conversation's items come first
        read_conversation(limit + 1)
    if order == "asc" or in_stored or after is None:
        found.extend(stored[start : start + limit + 1 - len(found)])
    if order == "desc" and len(found) <= limit:  # then the conversation's, newest first
        read_conversation(limit + 1 - len(found))
    return Page(found[:limit], len(found) > limit)


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
