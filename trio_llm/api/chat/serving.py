"""One model's request path: body, plan, admission, answer.

`ModelServing` serves ``/v1/completions`` and ``/v1/chat/completions``, and every API
translated into a chat completion (`ChatTranslated`; the API's own handlers plan it with
`plan_as` in their format and run it with `run_plan`). Every generating route walks one
path: read and validate the body (`parse`), build the request's `Plan` (`plan`, with the
`Planner` of `trio_llm.api.chat.planner`: one engine request per choice, every prompt of
a batch times ``n``), reserve places in the waiting line (`admit`), then either collect every choice
into one JSON body (`trio_llm.api.chat.run_choices`) or stream it as server-sent events
(`trio_llm.api.chat.streaming`), in the format the plan names (`trio_llm.api.chat.format`).
Everything that can be refused is refused before the first byte of the response, as a
proper HTTP error. (The embedding route, `trio_llm.api.embeddings`, uses the same
parsing, admission and engine.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from msgspec.structs import replace
from pydantic import BaseModel
from starlette.types import Receive

from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.format import ChatFormat
from trio_llm.api.chat.generation_request import GenerationRequest
from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.planner import Planner
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.run_choices import run_choices, run_connected
from trio_llm.api.chat.streaming import Finish, Stream
from trio_llm.api.chat.translated import ChatTranslated
from trio_llm.api.http.body_reading import CLIENT_CLOSED_REQUEST, read_body
from trio_llm.api.http.disconnect import EventStreamResponse, run_while_connected
from trio_llm.api.http.errors import (
    APIError,
    bad_request,
    engine_error,
    internal_error,
    invalid_request,
    unknown_model,
)
from trio_llm.api.http.parsing import parse_body
from trio_llm.errors import EngineError, InvalidRequest
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.generation_defaults import GenerationDefaults
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.lora_adapters import LoraAdapters
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.server_config import RequestLimits
from trio_llm.store import Store
from trio_llm.structured_output.grammar_check import default_compile_workers
from trio_llm.text.choice import Choice
from trio_llm.text.tokenizer import Tokenizer

_Request = TypeVar("_Request", bound=BaseModel)

#: The 400 of a route the served model cannot serve: what the route needs, by its task ...
NEEDS = {
    "embed": "an embedding model",
    "generate": "a model that generates text",
}
#: ... and what the served model is, by its task (`EngineReady.task`).
SERVES = {
    "embed": "is an embedding model (it serves /v1/embeddings, /score and /rerank)",
    "generate": (
        "generates text (ask for an embedding model this server serves: GET /v1/models; a "
        "server serves one from a sentence-transformers folder, or with --runner pooling)"
    ),
    "score": "is a cross-encoder (it serves /score and /rerank)",
}


class ModelServing:
    """Serves completions and chat completions with one engine and tokenizer.

    Args:
        engine: the running engine's client.
        tokenizer: the model's tokenizer (with chat template).
        model_names: names accepted in the ``model`` field; the first is the default.
        max_logprobs: most alternatives a request may ask for per token (``logprobs`` /
            ``top_logprobs``); more is a 400.
        max_num_waiting_requests: engine requests allowed to wait for their first output;
            past it new requests get a 503 with ``Retry-After`` at once. None: no limit.
        limits: per-request limits (choices, messages, stop strings), checked first.
        request_body_timeout: seconds a request body may take to arrive (a client that
            sends its headers and then trickles or withholds the body holds a connection
            only this long).
        tool_call_parser: the parser that serves ``tool_choice: "auto"``
            (``--enable-auto-tool-choice --tool-call-parser``); None refuses "auto".
        reasoning_parser: how the model marks its reasoning (``--reasoning-parser``,
            `trio_llm.text.reasoning`); None leaves the text as generated.
        disable_additional_properties: how object schemas are read
            (`GenerationRequest.set_server_options`; ``--structured-outputs-config``).
        max_tokens_policy: ``"clamp"`` lowers a ``max_tokens`` past the room the prompt
            leaves to that room; ``"strict"`` refuses it, as vLLM does
            (``--max-tokens-policy``).
        generation_defaults: the server's sampling defaults and output cap
            (``--generation-config``, ``--override-generation-config``).
        trust_request_chat_template: a request's own ``chat_template`` is rendered
            (sandboxed, within ``limits``); else it is a 400 (vLLM's flag).
    """

    def __init__(
        self,
        engine: EngineHandle,
        tokenizer: Tokenizer,
        model_names: tuple[str, ...],
        *,
        max_logprobs: int = 20,
        max_num_waiting_requests: int | None = None,
        limits: RequestLimits | None = None,
        request_body_timeout: float = 30.0,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        disable_additional_properties: bool = True,
        max_tokens_policy: str = "clamp",
        generation_defaults: GenerationDefaults | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        #: The server's store (stored responses, conversations, files, batches); None
        #: with ``--store-url none``. Set by the supervisor once it is open.
        self.store: Store | None = None
        self.limits = limits or RequestLimits()
        self.request_body_timeout = request_body_timeout
        self.tokenizer = tokenizer
        self.model_names = model_names
        #: The LoRA adapters served over this model (`LoraAdapters`), or None.
        self.adapters: LoraAdapters | None = None
        self.max_num_waiting_requests = max_num_waiting_requests
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size
        self.eos_token_ids = frozenset(engine.info.eos_token_ids)
        self.inputs = InputPreprocessor(
            tokenizer, self.max_model_len, self.vocab_size, max_tokens_policy=max_tokens_policy
        )
        #: Builds each request's `Plan`. Large structured-output specs are checked at
        #: once in worker threads (each builds a grammar): as many as the engine compiles.
        self.planner = Planner(
            inputs=self.inputs,
            grammar_checks=trio.CapacityLimiter(default_compile_workers()),
            limits=self.limits,
            generation_defaults=generation_defaults or GenerationDefaults(),
            max_logprobs=max_logprobs,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            disable_additional_properties=disable_additional_properties,
            scheduling_policy=engine.info.scheduling_policy,
            trust_request_chat_template=trust_request_chat_template,
        )

    # ------------------------------------------------------------ validation

    async def parse(self, model: type[_Request], request: Request) -> _Request:
        """Read and validate ``request``'s body as ``model`` (`trio_llm.api.http.parsing`).

        Raises:
            APIError: 400 naming the field at fault; 408 when the body takes longer than
                ``request_body_timeout`` to arrive (the connection is then closed).
        """
        body = await read_body(request, self.request_body_timeout)
        return await parse_body(
            model,
            body,
            request.headers.get("content-type"),
            self.limits,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )

    def resolve_model(self, name: str | None) -> str:
        """The served name to report (a model's or a LoRA adapter's); 404 for a name this
        server does not serve."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names and (self.adapters is None or name not in self.adapters):
            served = [*self.model_names, *(ref.name for ref in self.adapters or ())]
            raise unknown_model(name, served)
        return name

    # ------------------------------------------------------------ routes

    async def respond(self, request: GenerationRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/completions`` and ``POST /v1/chat/completions``: one JSON
        body, or server-sent events with ``stream``. A client that leaves while its
        request is still being checked (a grammar, a long prompt) stops that work."""
        plan = await run_while_connected(receive, partial(self.plan, request))
        if plan is None:  # the client left while the request was checked
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await self.run_plan(plan, request, receive)

    async def plan(
        self,
        request: GenerationRequest,
        make_format: Callable[..., ChatFormat] = ChatFormat,
        endpoint: str | None = None,
        *,
        count_only: bool = False,
    ) -> Plan:
        """Validate and tokenize a request into a `Plan` (chat: render the template first;
        ``make_format`` and ``count_only``: see `Planner.plan_chat`). ``endpoint``: the
        route errors name (default: the request's own).

        Raises:
            APIError: the request is invalid (400) or names an unknown model (404).
        """
        chat = isinstance(request, ChatCompletionRequest)
        endpoint = endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
        model = self.resolve_model(request.model)
        self.check_task("generate", endpoint, model)
        planner = self.planner
        try:
            if isinstance(request, ChatCompletionRequest):
                plan = await planner.plan_chat(request, model, make_format, count_only=count_only)
            elif isinstance(request, CompletionRequest):
                plan = await planner.plan_completion(request, model)
            else:
                raise TypeError(f"no plan for a {type(request).__name__}")
        except InvalidRequest as exc:
            raise invalid_request(exc) from exc
        lora = self.adapters.get(model) if self.adapters is not None else None
        if lora is not None:  # the adapter's requests: its weights, its own cached blocks
            plan.requests = [(ids, replace(p, lora=lora)) for ids, p in plan.requests]
        return plan

    def check_task(self, task: str, endpoint: str, model: str) -> None:
        """Refuse a route this model cannot serve (``task``, the route's need: ``embed`` or
        ``generate``; `NEEDS`, `SERVES`).

        Raises:
            APIError: 400 naming ``model``.
        """
        served = self.engine.info.task
        if served != task:
            message = f"{endpoint} needs {NEEDS[task]}; the model `{model}` {SERVES[served]}"
            raise APIError(400, message, param="model", code="model_not_supported")

    async def respond_translated(
        self, request: ChatTranslated, receive: Receive, make_format: Callable[..., ChatFormat]
    ) -> Response:
        """Handle a request of another API (`ChatTranslated`: Anthropic's ``POST
        /v1/messages``): it is translated into a chat completion and runs that one path;
        only the output format (``make_format``, given by the API's handler) differs."""
        planned = await self.plan_as(request, receive, make_format)
        if planned is None:  # the client left while the request was checked
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        chat, plan = planned
        return await self.run_plan(plan, chat, receive)

    async def plan_as(
        self,
        request: ChatTranslated,
        receive: Receive | None,
        make_format: Callable[..., ChatFormat],
    ) -> tuple[ChatCompletionRequest, Plan] | None:
        """The chat request a translated request asks for and its `Plan`, written in
        ``make_format``; None if the client left (``receive``) while it was checked.
        Without ``receive`` (a background response) the checks run to their end.

        Raises:
            APIError: as `plan`, naming the translated request's own fields.
        """
        to_chat = partial(request.to_chat, count_tokens=self.planner.count_prompt_tokens)
        work = partial(self.plan_translated, request, make_format, to_chat)
        return await (work() if receive is None else run_while_connected(receive, work))

    async def plan_translated(
        self,
        request: ChatTranslated,
        make_format: Callable[..., ChatFormat],
        to_chat: Callable[[], ChatCompletionRequest] | None = None,
        *,
        count_only: bool = False,
    ) -> tuple[ChatCompletionRequest, Plan]:
        """The chat request a translated request asks for (``to_chat``, by default
        ``request.to_chat``), and its `Plan` (``count_only``: see `Planner.plan_chat`).

        Raises:
            APIError: as `plan`, naming the translated request's own fields.
        """
        try:
            try:
                # The translation re-validates every message and checks echoed fields:
                # work that grows with the request, so it runs in a worker thread.
                chat = await trio.to_thread.run_sync(to_chat or request.to_chat)
                chat.bind_like(request)
                self.planner.map_thinking_switch(request, chat)
                plan = await self.plan(chat, make_format, request.ENDPOINT, count_only=count_only)
            except InvalidRequest as exc:
                raise invalid_request(exc) from exc
            plan.structured_param = request.api_names(plan.structured_param, "")[0]
            return chat, plan
        except APIError as exc:
            # The checks are the chat path's: name this API's fields instead.
            exc.param, exc.message = request.api_names(exc.param, exc.message)
            raise

    # ------------------------------------------------------------ generation

    def admit(self, plan: Plan) -> Admission:
        """Reserve places in the waiting line for every choice of ``plan``, or refuse.

        Hand the result to `run_choices` (or `Stream`), or `EngineClient.release` it.

        Raises:
            APIError: 400 when the plan has more choices than could ever wait; 503 (with
                ``Retry-After``) when the waiting line is full or the engine is stopping.
        """
        limit = self.max_num_waiting_requests
        if limit is not None and len(plan.requests) > limit:
            # It could never be admitted: a 503 would only make clients retry forever.
            raise bad_request(
                f"this request has {len(plan.requests)} choices (prompts x n), more than the "
                f"{limit} requests this server lets wait (--max-num-waiting-requests)",
                "n",
            )
        try:
            admission = self.engine.admit(len(plan.requests), limit)
        except EngineError as exc:
            raise engine_error(exc) from exc
        if not plan.response_id:  # a background response has its id from the start
            plan.response_id = plan.format.new_id()
            plan.created = int(time.time())
        return admission

    def make_choices(self, plan: Plan) -> list[Choice]:
        """One `Choice` (incremental detokenizer and stop strings) per engine request."""
        return [
            Choice(i, self.tokenizer, ids, params, self.eos_token_ids)
            for i, (ids, params) in enumerate(plan.requests)
        ]

    async def run_plan(
        self,
        plan: Plan,
        request: GenerationRequest,
        receive: Receive,
        finish: Finish | None = None,
    ) -> Response:
        """Admit and run ``plan``: one JSON body, or server-sent events with ``stream``.
        ``finish`` gets the whole response before it is sent (a stored response is
        written there: `trio_llm.api.responses.handlers`); an `APIError` it raises is the
        answer (or the stream's error event) instead.

        Raises:
            APIError: the request was refused (`admit`) or the engine failed it.
        """
        admission = self.admit(plan)
        choices = self.make_choices(plan)
        if request.stream:
            stream = Stream(self.engine, plan, choices, admission, finish)
            return EventStreamResponse(
                lambda emit: stream.run(emit, include_usage=request.include_usage)
            )

        collect = partial(run_choices, self.engine, plan, choices, admission, None)
        if not await run_connected(self.engine, receive, admission, collect, plan.structured_param):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            body = plan.format.response(plan, choices)
        except Exception as exc:  # a bug (a tool parser, the format): this answer alone
            raise internal_error(exc, "writing the response") from exc
        if finish is not None:
            await finish(body)
        return JSONResponse(body)
