"""The Responses API with the store: ``POST /v1/responses`` (stored or not, continued or
not, in the foreground or the background) and the routes of stored responses
(``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``, ``POST .../cancel``).

A request is prepared here (`ResponsesAPI.create`): ``store`` resolved (OpenAI's default
is to store: an absent ``store`` stores when the server has a store, ``--store-url none``
refuses an explicit one), the earlier context read (the items and output of a
``previous_response_id``, whose ``instructions`` are not carried over; or a
conversation's items), then it runs the one chat path (`ModelServing.run_plan`), and
the whole response is written to the store before it is sent (`_finish`: with the
conversation's new items, in one transaction). A store that fails then is the client's
error (503/507, or the stream's error event), and is logged. A background response is
planned here (a bad request is still a 400) and handed to
`trio_llm.api.responses.background`.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import trio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.request_body import check_json_text
from trio_llm.api.chat.serving import CLIENT_CLOSED_REQUEST, ModelServing
from trio_llm.api.http.disconnect import Emit, EventStreamResponse
from trio_llm.api.http.errors import APIError, bad_request, store_error
from trio_llm.api.http.lanes import BATCH_LANE
from trio_llm.api.http.store_routes import ListParams, need_store
from trio_llm.api.model_router import ModelRouter, as_router
from trio_llm.api.responses.background import BackgroundResponses
from trio_llm.api.responses.format import ResponsesFormat, responses_format
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.api.responses.store import record, stored_form, write
from trio_llm.errors import CONTEXT_LENGTH_EXCEEDED
from trio_llm.store import Evicted, NotFound, Store, Transaction, conversations, responses
from trio_llm.store.conversations import ConversationFull, ConversationLimits
from trio_llm.store.objects import now
from trio_llm.store.responses import ContextRef, SharedContext, StoredResponse


class ResponsesAPI:
    """The Responses API's routes over the server's models and its store (module doc).

    Args:
        models: the server's models (`ModelRouter`), or the one model's `ModelServing`.
        max_background: most background responses queued or in progress at once
            (``--max-background-responses``; `BackgroundResponses`); None: no limit.

    Attributes:
        background: the background responses of this server.
    """

    def __init__(
        self, models: ModelServing | ModelRouter, max_background: int | None = None
    ) -> None:
        self.router = as_router(models)
        self.background = BackgroundResponses(self.router, max_background)

    @property
    def store(self) -> Store | None:
        """The server's store (None with ``--store-url none``)."""
        return self.router.store

    async def serve_background(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The supervisor's hook: run background responses until `stop_background`,
        first those a stopped server left (read before ``task_status.started()``, so
        before this server answers a request), then those of servers that stop later
        (`BackgroundResponses.adopt`)."""
        store = self.store
        left = [] if store is None else await self.background.unfinished(store)
        resume = partial(self.background.adopt, store, left) if store else None
        await self.background.runs.serve(resume, task_status=task_status)

    def stop_background(self) -> None:
        """Cancel the background responses still running (left in progress in the store,
        to run again at the next start)."""
        self.background.runs.stop()

    # ------------------------------------------------------------ POST /v1/responses

    async def create(
        self, request: ResponsesRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Handle ``POST /v1/responses`` with the handlers of the model it names."""
        await self._prepare(request)
        try:
            planned = await serving.plan_as(request, receive, responses_format(request))
        except APIError as exc:
            if request.stream and exc.code == CONTEXT_LENGTH_EXCEEDED:
                return _failed_stream(serving, request, exc)
            raise
        if planned is None:  # the client left while the request was checked
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        chat, plan = planned
        if request.background:
            store = self._need_store()  # `_prepare` refused background without one
            return JSONResponse(await self.background.start(store, request, plan))
        keeps = request.stored or request.conversation_id is not None
        finish = partial(self._finish, request) if keeps else None
        return await serving.run_plan(plan, chat, receive, finish)

    async def _prepare(self, request: ResponsesRequest) -> None:
        """Resolve ``store`` and read the context the request continues.

        Raises:
            APIError: 400 for fields the server's store cannot serve or that do not go
                together, ``previous_response_not_found``, a previous response still in
                progress; 404 for an unknown conversation.
        """
        if request.background:
            # Background work: below every interactive request, as batch lines are.
            request.bind_lane(BATCH_LANE)
            if request.store is False:
                raise bad_request(
                    "background: true needs store: true (a background response is polled)",
                    "background",
                )
            if request.stream:
                raise bad_request(
                    "background: true with stream: true is not supported here: poll "
                    "GET /v1/responses/{id} instead",
                    "stream",
                )
        if request.previous_response_id is not None and request.conversation is not None:
            raise bad_request(
                "previous_response_id and conversation cannot be used together", "conversation"
            )
        if self.store is None:
            for name in ("store", "background", "previous_response_id", "conversation"):
                if getattr(request, name) not in (None, False):
                    raise bad_request(
                        f"`{name}` needs the server's store, and this server keeps no "
                        "responses or conversations (--store-url none): send store: false "
                        "and the whole conversation as input",
                        name,
                    )
            return
        context = await self._context(self.store, request)
        request.continue_from(context, stored=request.store is not False)
        if request.stored or request.conversation_id is not None:
            # Stored as sent (unknown fields are not kept): valid Unicode to the last key.
            check_json_text(request.input, "input")

    async def _context(self, store: Store, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The items a request continues: its conversation's (which must have room for
        its input), or its previous response's context and output; none for a new
        conversation. A conversation's items come as a `SharedContext`: the stored
        response refers to them instead of copying them."""
        previous_id, conversation_id = request.previous_response_id, request.conversation_id
        if conversation_id is not None:
            work = partial(
                _conversation_context,
                conversation_id=conversation_id,
                adding=request.items,
                limits=store.conversation_limits,
            )
            try:
                return await store.transaction(work)
            except (NotFound, ConversationFull) as exc:
                raise _named(store_error(exc), "conversation") from exc
        if previous_id is None:
            return []
        try:
            previous, context = await store.transaction(
                partial(responses.continuation, response_id=previous_id)
            )
        except NotFound as exc:
            message = (
                str(exc)
                if isinstance(exc, Evicted)
                else (f"Previous response with id '{previous_id}' not found.")
            )
            raise APIError(
                400, message, param="previous_response_id", code="previous_response_not_found"
            ) from exc
        if previous.active:
            raise bad_request(
                f"the previous response '{previous_id}' is still {previous.status}: wait "
                "until it has ended",
                "previous_response_id",
            )
        return context

    async def _finish(self, request: ResponsesRequest, body: dict[str, Any]) -> None:
        """Store a foreground response (and add its items to its conversation) before it
        is sent.

        Raises:
            APIError: the store failed (`store_error`); logged.
        """
        store = self._need_store()
        limits = store.conversation_limits
        work = partial(record, request, stored_form(request, body), new=True, limits=limits)
        await write(store, work, body["id"])

    # ------------------------------------------------------------ stored responses

    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/responses/{response_id}``: the stored response object."""
        if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
            raise bad_request(
                "stream=true is not supported: a stored response is returned whole", "stream"
            )
        stored = await self._get(request)
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/responses/{response_id}`` (a background one still running is
        cancelled first)."""
        response_id = request.path_params["response_id"]
        store = self._need_store()
        await self.background.runs.cancel(response_id)
        await store.transaction(partial(responses.delete, response_id=response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{response_id}/input_items``: the items the response was
        generated from (its earlier context too), a page of them."""
        work = partial(responses.input_items, response_id=request.path_params["response_id"])
        return await ListParams.of(request).page(self._need_store(), work)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/responses/{response_id}/cancel``: stop a background response (its
        engine request is aborted); one that has ended is returned as it is."""
        stored = await self._get(request)
        if not stored.background:
            raise bad_request(
                "only a response created with background: true can be cancelled",
                "response_id",
            )
        if stored.active:
            await self.background.cancel(self._need_store(), stored)
            stored = await self._get(request)
        return JSONResponse(stored.body)

    async def _get(self, request: Request) -> StoredResponse:
        """The stored response the path names, without its context (not read)."""
        store = self._need_store()
        response_id = request.path_params["response_id"]
        return await store.transaction(
            partial(responses.get, response_id=response_id, with_context=False)
        )

    def _need_store(self) -> Store:
        return need_store(self.store, "responses")


def _failed_stream(serving: ModelServing, request: ResponsesRequest, error: APIError) -> Response:
    """A streamed request whose prompt does not fit: OpenAI's stream of a failed
    response (``response.failed`` carrying ``context_length_exceeded``), which Codex
    reads as a full context window; other clients see the same error there."""
    response_format = ResponsesFormat(serving.tokenizer, request=request)
    plan = Plan(response_format, serving.resolve_model(request.model))
    plan.response_id, plan.created = response_format.new_id(), now()

    async def produce(emit: Emit) -> None:
        for name, data in response_format.stream_failed(plan, error):
            await emit(json.dumps(data, ensure_ascii=False), name)

    return EventStreamResponse(produce)


def _conversation_context(
    tx: Transaction,
    conversation_id: str,
    adding: list[dict[str, Any]],
    limits: ConversationLimits,
) -> SharedContext:
    """The conversation's items, as the context of a response that refers to them.

    Raises:
        NotFound: no such conversation.
        ConversationFull: ``adding`` (the response's input) would pass ``limits``.
    """
    conversations.check_room(tx, conversation_id, adding, limits)
    items, bound = conversations.context(tx, conversation_id)
    return SharedContext(items, ContextRef(conversation_id, bound), len(items))


def _named(error: APIError, param: str) -> APIError:
    error.param = param
    return error
