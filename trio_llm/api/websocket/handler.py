"""WebSocket token streaming: many generations multiplexed on one connection (``/v1/ws``).

The protocol (messages, close codes, auth, backpressure) is specified in
``docs/websocket.md``. In short: the client sends ``completion`` / ``chat`` / ``cancel``
messages, each naming a generation by a client-chosen ``id``; the server answers with
``delta`` events, then one ``done`` (or one ``error``) per generation.

Each connection is one nursery: a reader (the only task that receives, and it never blocks
on anything else, so hypercorn can always hand over the next message or the hang-up), a
writer that drains a bounded channel of outgoing events into the socket, a watcher that
notices the engine dying or the server stopping, one task per generation, and one that
passes the reader's error events on in order (a refused message costs only its queued
event, up to `MAX_PENDING_ERROR_CHARS` for the connection). Generation
tasks wait when the channel is full, so a client that stops reading stalls only its own
generations; their engine output coalesces in the `EngineClient` mailbox, which pauses
them in the engine once 64 tokens are unread (no batch slot is held for a client that
does not read). A client that leaves cancels the nursery, which aborts every engine
request of the connection (``open_requests`` sends one `AbortRequests` on the way out).

The handshake's checks (origin, API key) are in `trio_llm.api.websocket.handshake`; the
client messages' checks and the ``error`` / ``done`` events in
`trio_llm.api.websocket.messages`.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import trio
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.run_choices import OnDelta, run_choices
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.errors import (
    APIError,
    bad_request,
    engine_error,
    internal_error,
)
from trio_llm.api.http.parsing import (
    INLINE_PARSE_BYTES,
    JSONTooDeepError,
    load_json,
    nested_too_deep,
)
from trio_llm.api.model_router import ModelRouter, keep_alive_of
from trio_llm.api.websocket.handshake import authorized, origin_allowed
from trio_llm.api.websocket.messages import (
    GENERATION_TYPES,
    MAX_QUOTED_TYPE_LENGTH,
    done_event,
    error_event,
    invalid_id,
    parse_request,
)
from trio_llm.errors import EngineDeadError, EngineError
from trio_llm.server_config import ServerConfig
from trio_llm.text.choice import Choice, ChoiceDelta

logger = logging.getLogger(__name__)

#: The endpoint's path.
WEBSOCKET_PATH = "/v1/ws"

#: Most generations running at once on one connection; more get a ``too_many_generations``
#: error event.
MAX_GENERATIONS_PER_CONNECTION = 64

#: Outgoing events buffered per connection before generation tasks wait (events).
OUTGOING_EVENT_BUFFER = 32

#: Error events the reader may have waiting for room in the outgoing buffer (characters of
#: JSON, summed): thousands of refused messages (a burst of generations over
#: `MAX_GENERATIONS_PER_CONNECTION`, or invalid ones). A client that keeps sending them
#: without reading the answers is disconnected past this.
MAX_PENDING_ERROR_CHARS = 1024 * 1024

#: Close codes (RFC 6455 section 7.4.1).
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INTERNAL_ERROR = 1011

#: What the server raises when a send finds the client gone (starlette's exceptions; an
#: OSError from the transport; RuntimeError: starlette refusing a send after the close).
_DISCONNECTED = (WebSocketDisconnect, RuntimeError, OSError)


def install_websocket(app: FastAPI, router: ModelRouter, config: ServerConfig) -> None:
    """Serve the streaming protocol at ``/v1/ws`` on ``app``: each generation runs on the
    model its message names (``model``; a lease on it while it runs).

    With ``config.api_key`` set, a client must present the key in the handshake
    (``Authorization: Bearer KEY`` or ``x-api-key: KEY``, as on every HTTP ``/v1`` route,
    or the ``api_key`` query parameter for browsers);
    otherwise the connection is accepted and closed at once with code 1008.

    A handshake whose ``Origin`` is not allowed is refused with HTTP 403 before anything
    else (see `origin_allowed`): a web page on another site cannot drive the server
    through its visitor's browser.
    """
    key = config.api_key.encode() if config.api_key is not None else None
    allowed_origins = config.allowed_origins

    @app.websocket(WEBSOCKET_PATH)
    async def websocket_endpoint(websocket: WebSocket) -> None:
        if not origin_allowed(websocket.headers, allowed_origins):
            await websocket.close(CLOSE_POLICY_VIOLATION)  # before accept: HTTP 403
            return
        await websocket.accept()
        if key is not None and not authorized(websocket, key):
            await _close_quietly(websocket, CLOSE_POLICY_VIOLATION, "invalid or missing API key")
            return
        try:
            await _Connection(websocket, router).run()
        except Exception:  # a bug: end this connection, keep the server
            logger.exception("internal error in a WebSocket connection")
            await _close_quietly(websocket, CLOSE_INTERNAL_ERROR, "internal error")


async def _close_quietly(websocket: WebSocket, code: int, reason: str) -> None:
    """Send a close frame unless the client is already gone."""
    try:
        await websocket.close(code, reason)
    except _DISCONNECTED:
        pass


class _Connection:
    """One WebSocket connection: its generations, its outgoing events, how it ends."""

    def __init__(self, websocket: WebSocket, router: ModelRouter) -> None:
        self.websocket = websocket
        self.router = router
        self.active: dict[str, trio.CancelScope] = {}  # generation id -> its cancel scope
        # The reader's error events, in order, until the outbox has room (never blocks
        # the reader; bounded by `MAX_PENDING_ERROR_CHARS`).
        self.num_pending_error_chars = 0
        self._errors, self._errors_receive = trio.open_memory_channel[str](math.inf)
        self.close_requested = trio.Event()
        self.close_code = CLOSE_INTERNAL_ERROR
        self.close_reason = ""
        self.abort_on_close = False
        self._outbox, self._outbox_receive = trio.open_memory_channel[str](OUTGOING_EVENT_BUFFER)
        self._generations: trio.Nursery | None = None

    async def run(self) -> None:
        """Serve until the client leaves (everything is aborted at once) or the server
        closes the connection (after the last events of the ending generations)."""
        async with trio.open_nursery() as connection:
            async with trio.open_nursery() as output:
                output.start_soon(self._write_loop, connection.cancel_scope)
                async with self._outbox, trio.open_nursery() as generations:
                    self._generations = generations
                    generations.start_soon(self._error_loop)
                    connection.start_soon(self._read_loop, connection.cancel_scope)
                    connection.start_soon(self._watch_engine)
                    await self.close_requested.wait()
                    self._errors.close()  # the errors queued so far still go out
                    if self.abort_on_close:
                        generations.cancel_scope.cancel()
                # The outbox is closed: the writer sends what is left, then returns.
            await _close_quietly(self.websocket, self.close_code, self.close_reason)
            connection.cancel_scope.cancel()

    def request_close(self, code: int, reason: str, *, abort: bool) -> None:
        """Close the connection with ``code`` once the generations have ended; ``abort``
        ends them at once, otherwise they finish (with errors, when the engine is gone)."""
        if not self.close_requested.is_set():
            self.close_code, self.close_reason, self.abort_on_close = code, reason, abort
            self.close_requested.set()

    # ------------------------------------------------------------ tasks

    async def _read_loop(self, connection: trio.CancelScope) -> None:
        """Receive until the client leaves; wait for nothing but the socket (and for a
        worker thread parsing a large message)."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                connection.cancel()  # aborts every engine request of this connection
                return
            if self.close_requested.is_set():
                continue  # closing: late messages are not answered
            text = message.get("text")
            if text is None:
                self.request_close(
                    CLOSE_UNSUPPORTED_DATA, "binary frames are not supported", abort=True
                )
            else:
                await self._handle(text)

    async def _write_loop(self, connection: trio.CancelScope) -> None:
        async for text in self._outbox_receive:
            try:
                await self.websocket.send_text(text)
            except _DISCONNECTED:
                connection.cancel()
                return

    async def _error_loop(self) -> None:
        """Move the reader's error events into the outbox, in order."""
        async with self._errors_receive:
            async for text in self._errors_receive:
                try:
                    await self._outbox.send(text)
                finally:
                    self.num_pending_error_chars -= len(text)

    async def _watch_engine(self) -> None:
        await self.router.ended.wait()
        if isinstance(self.router.error, EngineDeadError):
            self.request_close(CLOSE_INTERNAL_ERROR, "the engine core died", abort=False)
        else:
            self.request_close(CLOSE_GOING_AWAY, "the server is shutting down", abort=False)

    # ------------------------------------------------------------ messages

    async def _handle(self, text: str) -> None:
        """Act on one client message (answers go out from other tasks); only parsing a
        large message waits, in a worker thread."""
        too_deep: APIError | None = None
        try:
            if len(text) > INLINE_PARSE_BYTES:
                message = await trio.to_thread.run_sync(load_json, text)
            else:
                message = load_json(text)
        except JSONTooDeepError as exc:
            # Refused whole; the members before the deep one may say whose it is.
            message, too_deep = exc.members, nested_too_deep(exc.field)
        except ValueError:
            self._reply_error(None, bad_request("the message is not valid JSON"))
            return
        if not isinstance(message, dict):
            self._reply_error(None, bad_request("a message must be a JSON object"))
            return
        generation_id = message.get("id")
        kind = message.get("type")
        id_error = invalid_id(generation_id)
        if too_deep is not None:
            # The error ends that generation if the message started one (as a validation
            # error would); otherwise it names none.
            starts = kind in GENERATION_TYPES and id_error is None
            self._reply_error(
                generation_id if starts and generation_id not in self.active else None, too_deep
            )
            return
        if id_error is not None:
            self._reply_error(None, id_error)
            return
        if kind == "cancel":
            scope = self.active.get(generation_id)
            if scope is not None:  # unknown or finished: nothing to do (a normal race)
                scope.cancel()
            return
        running = generation_id in self.active
        if kind not in GENERATION_TYPES:
            quoted = repr(kind)
            if len(quoted) > MAX_QUOTED_TYPE_LENGTH:
                quoted = quoted[:MAX_QUOTED_TYPE_LENGTH] + "..."
            problem = f"unknown message type {quoted}; expected completion, chat or cancel"
            # An error naming a running generation would look like its end.
            self._reply_error(None if running else generation_id, bad_request(problem, "type"))
        elif running:
            problem = f"a generation with id {generation_id!r} is already running"
            self._reply_error(None, APIError(400, problem, param="id", code="duplicate_id"))
        elif len(self.active) >= MAX_GENERATIONS_PER_CONNECTION:
            problem = (
                f"this connection already runs {MAX_GENERATIONS_PER_CONNECTION} generations; "
                "wait for one to end"
            )
            self._reply_error(generation_id, APIError(429, problem, code="too_many_generations"))
        else:
            self._start(generation_id, kind, message, len(text) > INLINE_PARSE_BYTES)

    def _start(self, generation_id: str, kind: str, message: dict[str, Any], large: bool) -> None:
        """Run a new generation in the connection's nursery (``large``: parse it in a
        worker thread)."""
        if self._generations is None:
            raise RuntimeError("a generation arrived before the connection was served")
        scope = trio.CancelScope()
        self.active[generation_id] = scope
        self._generations.start_soon(self._generate, generation_id, kind, message, scope, large)

    def _reply_error(self, generation_id: str | None, error: APIError) -> None:
        """Queue an error event without waiting: the reader must go on receiving, or a
        hang-up would not be noticed (hypercorn hands it over in the same queue)."""
        if self.close_requested.is_set():
            return  # closing: the answer would not be sent
        text = json.dumps(error_event(generation_id, error.body()), ensure_ascii=False)
        if self.num_pending_error_chars + len(text) > MAX_PENDING_ERROR_CHARS:
            self.request_close(CLOSE_POLICY_VIOLATION, "too many unread error events", abort=True)
            return
        self.num_pending_error_chars += len(text)
        self._errors.send_nowait(text)

    async def _send(self, event: dict[str, Any]) -> None:
        await self._outbox.send(json.dumps(event, ensure_ascii=False))

    # ------------------------------------------------------------ generations

    async def _generate(
        self,
        generation_id: str,
        kind: str,
        message: dict[str, Any],
        scope: trio.CancelScope,
        large: bool,
    ) -> None:
        """Run one generation (on the model it names) and send its ``done`` or ``error``
        event."""
        try:
            name = message.get("model")
            name = name if isinstance(name, str) else None
            keep_alive = keep_alive_of(message.get("keep_alive"))
            async with self.router.leased(name, keep_alive) as serving:
                request = await self._validated(serving, kind, message, large)
                event = await self._run_generation(serving, generation_id, request, scope)
        except APIError as exc:
            event = error_event(generation_id, exc.body())
        except EngineError as exc:
            event = error_event(generation_id, engine_error(exc).body())
        except Exception as exc:  # a bug: end this generation with an error, as HTTP does
            event = error_event(generation_id, internal_error(exc, "generating").body())
        finally:
            # Free the id before its last event leaves: the client may reuse it at once.
            del self.active[generation_id]
        await self._send(event)

    async def _validated(
        self, serving: ModelServing, kind: str, message: dict[str, Any], large: bool
    ) -> CompletionRequest | ChatCompletionRequest:
        """A ``completion`` / ``chat`` message validated (`parse_request`; in a worker
        thread when the message is ``large``).

        Raises:
            APIError: a 400 naming the field at fault, or ``tools`` for a chat with tools.
        """
        if large:  # validation grows with the message: keep the event loop free
            request = await trio.to_thread.run_sync(parse_request, kind, message, serving)
        else:
            request = parse_request(kind, message, serving)
        if isinstance(request, ChatCompletionRequest) and request.effective_tool_choice != "none":
            # Delta events carry text only; tool calls are an HTTP feature for now.
            raise bad_request(
                "tools are served on POST /v1/chat/completions; over the WebSocket only with "
                'tool_choice "none"',
                "tools",
            )
        return request

    async def _run_generation(
        self,
        serving: ModelServing,
        generation_id: str,
        request: CompletionRequest | ChatCompletionRequest,
        scope: trio.CancelScope,
    ) -> dict[str, Any]:
        """Run ``request`` under ``scope``, sending its delta events; its ``done`` event."""
        engine = serving.engine
        plan = await serving.plan(request)
        admission = serving.admit(plan)
        try:
            choices = serving.make_choices(plan)
            if not scope.cancel_called:  # a cancel may arrive while the prompt is prepared
                with scope:
                    on_delta = self._delta_sender(generation_id, plan, choices)
                    try:
                        await run_choices(engine, plan, choices, admission, on_delta)
                    except EngineError as exc:
                        raise engine_error(exc, plan.structured_param) from exc
        finally:
            engine.release(admission)
        return done_event(generation_id, plan, choices)

    def _delta_sender(self, generation_id: str, plan: Plan, choices: list[Choice]) -> OnDelta:
        """The ``on_delta`` callback that turns each piece of output into a delta event."""
        num_tokens_sent = [0] * len(choices)

        async def on_delta(choice: Choice, piece: ChoiceDelta) -> None:
            num_tokens = choice.num_output_tokens - num_tokens_sent[choice.index]
            num_tokens_sent[choice.index] = choice.num_output_tokens
            if not (piece.text or num_tokens or piece.logprobs):
                return  # e.g. the end of a choice whose last token had no text
            event: dict[str, Any] = {
                "type": "delta",
                "id": generation_id,
                "index": choice.index,
                "text": piece.text,
                "num_tokens": num_tokens,
            }
            if plan.num_top_logprobs is not None:
                event["logprobs"] = plan.format.delta_logprobs(plan, choice, piece)
            await self._send(event)

        return on_delta
