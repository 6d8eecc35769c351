"""The OpenAI completion and chat-completion handlers: prompt -> engine -> text.

Both routes share one path: validate and tokenize into a `Plan` (one engine request per
choice: every prompt of a batch times ``n``), reserve places in the waiting line, then
either collect every choice (one JSON body) or stream chunks as server-sent events ending
with ``data: [DONE]`` (see `trio_llm.api.streaming`). Everything that can be refused is
refused before the first byte of the response, as a proper HTTP error. The response
shapes follow the OpenAI API reference (``text_completion``, ``chat.completion``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import msgspec
import trio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from trio_llm.api.anthropic import CountTokensRequest, MessagesRequest
from trio_llm.api.anthropic_format import MessagesFormat
from trio_llm.api.chat_request import ChatCompletionRequest
from trio_llm.api.completion_request import CompletionRequest
from trio_llm.api.disconnect import Emit, EventStreamResponse, run_while_connected
from trio_llm.api.embeddings import (
    EmbeddingRequest,
    check_dimensions,
    encode,
    matryoshka_dimensions,
    shorten,
)
from trio_llm.api.embeddings import response as embeddings_response
from trio_llm.api.errors import APIError, bad_request, engine_error, invalid_request
from trio_llm.api.formats import ChatFormat, CompletionFormat
from trio_llm.api.generation_request import GenerationRequest
from trio_llm.api.middleware import RequestBodyTooLarge
from trio_llm.api.parsing import parse_body
from trio_llm.api.plan import Plan, run_choices
from trio_llm.api.responses import ResponsesRequest
from trio_llm.api.responses_format import ResponsesFormat
from trio_llm.api.streaming import Stream
from trio_llm.api.tool_calls import NamedCallParser, ToolCallParser
from trio_llm.api.tool_parsers import make_parser, required_parser
from trio_llm.api.translated_request import ChatTranslated
from trio_llm.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ContextLengthError,
    EngineError,
    InvalidRequest,
)
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.generation_defaults import GenerationDefaults
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.preprocess import InputPreprocessor, fan_out
from trio_llm.messages import SamplingParams
from trio_llm.server_config import RequestLimits
from trio_llm.structured_output.grammar_check import default_compile_workers
from trio_llm.text.choice import Choice
from trio_llm.text.reasoning import ReasoningFormat, reasoning_format
from trio_llm.text.stop import compile_stops
from trio_llm.text.tokenizer import Tokenizer

_Request = TypeVar("_Request", bound=BaseModel)

#: HTTP status for a request whose client disconnected (nginx's convention; never seen).
CLIENT_CLOSED_REQUEST = 499

#: An embeddings request with more inputs than this is tokenized and rendered in a
#: worker thread (both grow with the request).
INLINE_EMBEDDING_INPUTS = 8

#: Stop strings with more characters than this in all are compiled in a worker thread.
INLINE_STOP_CHARS = 1024

#: Output constraints of at most this many characters of spec have their grammars
#: checked at once (a few milliseconds); larger ones queue for `OpenAIServing.grammar_checks`.
SMALL_GRAMMAR_CHARS = 16 * 1024


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None = None  # as given, for echo; None for token-id prompts


class OpenAIServing:
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
    ) -> None:
        self.engine = engine
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.disable_additional_properties = disable_additional_properties
        self.limits = limits or RequestLimits()
        self.request_body_timeout = request_body_timeout
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_logprobs = max_logprobs
        self.max_num_waiting_requests = max_num_waiting_requests
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size
        self.eos_token_ids = frozenset(engine.info.eos_token_ids)
        self.inputs = InputPreprocessor(
            tokenizer, self.max_model_len, self.vocab_size, max_tokens_policy=max_tokens_policy
        )
        #: Large structured-output specs checked at once in worker threads (each builds
        #: a grammar): as many as the engine compiles at once.
        self.grammar_checks = trio.CapacityLimiter(default_compile_workers())

    # ------------------------------------------------------------ validation

    async def parse(self, model: type[_Request], request: Request) -> _Request:
        """Read and validate ``request``'s body as ``model`` (`trio_llm.api.parsing`).

        Raises:
            APIError: 400 naming the field at fault; 408 when the body takes longer than
                ``request_body_timeout`` to arrive (the connection is then closed).
        """
        try:
            with trio.fail_after(self.request_body_timeout):
                body = await request.body()
        except trio.TooSlowError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.request_body_timeout:g} s "
                "(--request-body-timeout)",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:
            # A client that leaves mid-body is no error of the server's: no traceback.
            raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request") from None
        except RequestBodyTooLarge as exc:
            # Answered by BodySizeLimitMiddleware with its 413; raised as an APIError so
            # that it is not logged as a server error on the way.
            raise APIError(413, str(exc), code="request_too_large") from None
        return await parse_body(
            model,
            body,
            request.headers.get("content-type"),
            self.limits,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )

    def resolve_model(self, name: str | None) -> str:
        """The served name to report; 404 for a name this server does not serve."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves {list(self.model_names)}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return name

    def _check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.max_logprobs:
            raise bad_request(
                f"{param}={value} is more than this server's limit of {self.max_logprobs} "
                "(--max-logprobs)",
                param,
            )

    async def _check_common(self, request: GenerationRequest) -> None:
        request.set_server_options(
            tool_call_parser=self.tool_call_parser,
            disable_additional_properties=self.disable_additional_properties,
        )
        request.check_supported()
        if request.stop_token_ids:
            self.inputs.check_token_ids(request.stop_token_ids, "stop_token_ids")
        stops = request.stop_strings
        if sum(map(len, stops)) > INLINE_STOP_CHARS:
            # Build the automaton off the loop; the choices then find it in the cache.
            await trio.to_thread.run_sync(compile_stops, tuple(dict.fromkeys(stops)))
        if request.asks_for_structured_output:
            # Parse and check the spec off the loop; `_params` then finds the result.
            # First its size limits (cheap), then its grammar: a large one waits its turn
            # among at most `grammar_checks` at once, so a small one never waits behind
            # hostile ones. A check whose client leaves is abandoned (its thread ends by
            # itself, bounded by the limits and llguidance's own).
            chars = await trio.to_thread.run_sync(
                request.structured_output_chars, abandon_on_cancel=True
            )
            limiter = self.grammar_checks if chars > SMALL_GRAMMAR_CHARS else None
            await trio.to_thread.run_sync(
                request.structured_output, limiter=limiter, abandon_on_cancel=True
            )

    def _max_tokens(
        self, requested: int | None, num_prompt: int, param: str, prompt_param: str
    ) -> int:
        """The output budget of one prompt (`InputPreprocessor.resolve_max_tokens`, with
        the server's generation defaults).

        Raises:
            ContextLengthError: the prompt (or, strict, the output asked for) does not fit.
        """
        defaults = self.generation_defaults
        if requested == 0:  # echo only: no output, whatever the server's defaults
            return self.inputs.resolve_max_tokens(0, num_prompt, param, prompt_param)
        return self.inputs.resolve_max_tokens(
            requested,
            num_prompt,
            param,
            prompt_param,
            default=defaults.max_tokens,
            cap=defaults.max_tokens_cap,
        )

    def _params(
        self,
        request: GenerationRequest,
        max_tokens: int,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> list[SamplingParams]:
        """One `SamplingParams` per sample (``n``), seeds ``seed + i``."""
        if max_tokens and request.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens={request.min_tokens} is more than the {max_tokens} output tokens "
                "allowed",
                "min_tokens",
            )
        base = request.sampling_params(
            max_tokens,
            self.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            defaults=self.generation_defaults.sampling,
        )
        try:
            base.validate(self.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        return fan_out(base, request.n)

    # ------------------------------------------------------------ routes

    async def respond(self, request: GenerationRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/completions`` and ``POST /v1/chat/completions``: one JSON
        body, or server-sent events with ``stream``. A client that leaves while its
        request is still being checked (a grammar, a long prompt) stops that work."""
        plan = await run_while_connected(receive, partial(self.plan, request))
        if plan is None:  # the client left while the request was checked
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await self._respond(plan, request, receive)

    async def plan(self, request: GenerationRequest) -> Plan:
        """Validate and tokenize a request into a `Plan` (chat: render the template first).

        Raises:
            APIError: the request is invalid (400) or names an unknown model (404).
        """
        try:
            if isinstance(request, ChatCompletionRequest):
                return await self._plan_chat(request)
            assert isinstance(request, CompletionRequest)
            return await self._plan_completion(request)
        except InvalidRequest as exc:
            raise invalid_request(exc) from exc

    async def _plan_completion(self, request: CompletionRequest) -> Plan:
        model = self.resolve_model(request.model)
        self._check_task("generate", "/v1/completions")
        await self._check_common(request)
        if request.suffix:
            raise bad_request("`suffix` (insertion) is not supported by this model", "suffix")
        self._check_logprobs(request.logprobs, "logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request(
                "prompt_logprobs is served in non-streamed responses only", "prompt_logprobs"
            )
        if request.max_tokens == 0 and not request.echo:
            raise bad_request(
                "max_tokens must be at least 1 (0 is only allowed with echo=true)", "max_tokens"
            )
        prompts = await self._completion_prompts(request)
        if len(prompts) * request.n > self.limits.max_choices:
            raise bad_request(
                f"{len(prompts)} prompts x n={request.n} is more than this server's limit of "
                f"{self.limits.max_choices} choices per request (--max-choices)",
                "n",
            )
        wanted = [request.logprobs if request.echo else None, request.prompt_logprobs]
        counts = [count for count in wanted if count is not None]
        prompt_logprobs = max(counts) if counts else None
        plan = Plan(
            CompletionFormat(self.tokenizer),
            model,
            echo=request.echo,
            num_top_logprobs=request.logprobs,
            num_prompt_logprobs=request.prompt_logprobs,
            structured_param=request.structured_param,
        )
        for prompt in prompts:
            max_tokens = self._max_tokens(
                request.max_tokens, len(prompt.token_ids), "max_tokens", "prompt"
            )
            params = self._params(
                request, max_tokens, logprobs=request.logprobs, prompt_logprobs=prompt_logprobs
            )
            echo_text = prompt.text
            if request.echo and echo_text is None:
                echo_text = self.tokenizer.decode(
                    prompt.token_ids, skip_special_tokens=request.skip_special_tokens
                )
            plan.add_prompt(prompt.token_ids, params, echo_text)
        return plan

    async def _completion_prompts(self, request: CompletionRequest) -> list[_Prompt]:
        prompt = request.prompt
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif isinstance(prompt[0], int):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise bad_request("the prompt is empty", "prompt")
                ids = await self.inputs.encode_async(item, "prompt", special_tokens=True)
                prompts.append(_Prompt(ids, item))
            else:
                if not item:
                    raise bad_request("the prompt is empty", "prompt")
                prompts.append(_Prompt(self.inputs.check_token_ids(item, "prompt")))
        return prompts

    @property
    def task(self) -> str:
        """``"generate"`` or ``"embed"`` (`trio_llm.messages.EngineReady.task`)."""
        return self.engine.info.task

    def _check_task(self, task: str, endpoint: str) -> None:
        if self.task == task:
            return
        if task == "embed":
            message = (
                f"{endpoint} needs an embedding model; the model served here generates text "
                "(start a server with a sentence-transformers folder, or --runner pooling)"
            )
        else:
            message = (
                f"{endpoint} needs a model that generates text; the model served here is an "
                "embedding model (it serves /v1/embeddings)"
            )
        raise APIError(400, message, param="model", code="model_not_supported")

    async def embed(self, request: EmbeddingRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/embeddings`` (`trio_llm.api.embeddings`): tokenize every
        input, submit them together (the engine batches them with other clients'), and
        answer their vectors in input order.

        Raises:
            APIError: 400 for a generating model, an empty or too long input, or a
                ``dimensions`` the model cannot give; 503 when the waiting line is full.
        """
        model = self.resolve_model(request.model)
        self._check_task("embed", "/v1/embeddings")
        check_dimensions(
            request.dimensions,
            self.engine.info.embedding_dim,
            matryoshka_dimensions(self.engine.info.model_dir),
        )
        items = request.inputs()

        def tokenize() -> list[list[int]]:
            prompts = []
            for item in items:
                if isinstance(item, str):
                    ids = self.inputs.encode(item, "input", special_tokens=True)
                else:
                    ids = self.inputs.check_token_ids(item, "input")
                if len(ids) > self.max_model_len:
                    raise ContextLengthError(
                        self.max_model_len, len(ids), "input", prompt_name="input"
                    )
                prompts.append(ids)
            return prompts

        try:
            # Up to 2,048 inputs: their tokenizing grows with the request, so it runs in
            # a worker thread unless there is little of it.
            if len(items) <= INLINE_EMBEDDING_INPUTS and sum(map(len, items)) < 4096:
                prompts = tokenize()
            else:
                prompts = await trio.to_thread.run_sync(tokenize)
        except InvalidRequest as exc:
            raise invalid_request(exc) from exc
        params = SamplingParams(max_tokens=0)
        plan = Plan(ChatFormat(self.tokenizer), model)  # only for admission's bookkeeping
        for ids in prompts:
            plan.add_prompt(ids, [params], None)
        admission = self.admit(plan)
        vectors: list[list[float]] = [[] for _ in prompts]

        async def collect() -> None:
            async with self.engine.open_requests(plan.requests, admission) as streams:
                for i, stream in enumerate(streams):
                    async for delta in stream:
                        if delta.embedding is not None:
                            vectors[i] = delta.embedding

        if not await self._run_connected(receive, admission, collect):
            return Response(status_code=CLIENT_CLOSED_REQUEST)

        def render() -> bytes:
            data = [
                encode(shorten(vector, request.dimensions), request.encoding_format)
                for vector in vectors
            ]
            body = embeddings_response(model, data, sum(plan.prompt_lengths))
            # msgspec, not json.dumps: either holds the GIL for the whole body, so the
            # worker thread stalls the event loop while it runs; 2,048 vectors of 384
            # floats take json.dumps about a second and msgspec a twentieth of that.
            return msgspec.json.encode(body)

        # Hundreds of thousands of floats for a large batch: rendered off the event loop.
        if len(vectors) <= INLINE_EMBEDDING_INPUTS:
            content = render()
        else:
            content = await trio.to_thread.run_sync(render)
        return Response(content, media_type="application/json")

    async def respond_as(
        self, request: MessagesRequest | ResponsesRequest, receive: Receive
    ) -> Response:
        """Handle ``POST /v1/messages`` (Anthropic) and ``POST /v1/responses`` (OpenAI):
        the request is translated into a chat completion and runs that one path; only
        the output format differs."""
        to_chat: Callable[[], ChatCompletionRequest] = request.to_chat
        if isinstance(request, MessagesRequest):
            make_format: Callable[..., ChatFormat] = MessagesFormat
            endpoint = "/v1/messages"
            to_chat = partial(request.to_chat, count_tokens=self._count_prompt_tokens)
        else:
            make_format = partial(ResponsesFormat, request=request)
            endpoint = "/v1/responses"
        try:
            planned = await run_while_connected(
                receive,
                partial(self._plan_translated, request, make_format, endpoint, to_chat),
            )
        except APIError as exc:
            if (
                isinstance(request, ResponsesRequest)
                and request.stream
                and exc.code == (CONTEXT_LENGTH_EXCEEDED)
            ):
                return self._failed_response_stream(request, exc)
            raise
        if planned is None:  # the client left while the request was checked
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        chat, plan = planned
        return await self._respond(plan, chat, receive)

    def _failed_response_stream(self, request: ResponsesRequest, error: APIError) -> Response:
        """A streamed Responses request whose prompt does not fit: OpenAI's stream of a
        failed response (``response.failed`` carrying ``context_length_exceeded``), which
        Codex reads as a full context window; other clients see the same error there."""
        response_format = ResponsesFormat(self.tokenizer, request=request)
        plan = Plan(response_format, self.resolve_model(request.model))
        plan.response_id = response_format.new_id()
        plan.created = int(time.time())

        async def produce(emit: Emit) -> None:
            for name, data in response_format.stream_failed(plan, error):
                await emit(json.dumps(data, ensure_ascii=False), name)

        return EventStreamResponse(produce)

    async def _plan_translated(
        self,
        request: ChatTranslated,
        make_format: Callable[..., ChatFormat],
        endpoint: str,
        to_chat: Callable[[], ChatCompletionRequest] | None = None,
        *,
        count_only: bool = False,
    ) -> tuple[ChatCompletionRequest, Plan]:
        """The chat request a translated request asks for (``to_chat``, by default
        ``request.to_chat``), and its `Plan` (``count_only``: see `_plan_chat`).

        Raises:
            APIError: as `plan`, naming the translated request's own fields.
        """
        try:
            try:
                # The translation re-validates every message and checks echoed fields:
                # work that grows with the request, so it runs in a worker thread.
                chat = await trio.to_thread.run_sync(to_chat or request.to_chat)
                self._map_thinking_switch(request, chat)
                plan = await self._plan_chat(chat, make_format, endpoint, count_only=count_only)
            except InvalidRequest as exc:
                raise invalid_request(exc) from exc
            plan.structured_param = request.api_names(plan.structured_param, "")[0]
            return chat, plan
        except APIError as exc:
            # The checks are the chat path's: name this API's fields instead.
            exc.param, exc.message = request.api_names(exc.param, exc.message)
            raise

    async def count_tokens(self, request: CountTokensRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/messages/count_tokens`` (Anthropic): the prompt's token
        count, from the same validation, template and tokenizer as ``/v1/messages``."""
        endpoint = "/v1/messages/count_tokens"
        to_chat = partial(request.to_chat, count_tokens=self._count_prompt_tokens)
        _, plan = await self._plan_translated(
            request, MessagesFormat, endpoint, to_chat, count_only=True
        )
        return JSONResponse({"input_tokens": sum(plan.prompt_lengths)})

    def _count_prompt_tokens(self, request: ChatCompletionRequest) -> int:
        """The prompt tokens of a chat request, rendered as `_plan_chat` renders it
        (whatever its length: no context check). Runs in a worker thread (`to_chat`).

        Raises:
            InvalidRequest: the chat template rejects the messages.
        """
        text = self.inputs.render_chat(
            request.template_messages(),
            tools=request.template_tools(),
            continue_final_message=request.continue_final_message,
            template_kwargs=request.template_kwargs(self.tokenizer.special_tokens),
            fold_late_system=request.translated.fold_late_system,
        )
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def _plan_chat(
        self,
        request: ChatCompletionRequest,
        make_format: Callable[..., ChatFormat] = ChatFormat,
        endpoint: str = "/v1/chat/completions",
        *,
        count_only: bool = False,
    ) -> Plan:
        """Validate, render and tokenize a chat request into a `Plan`.

        Args:
            count_only: only its prompt is wanted (``/v1/messages/count_tokens``): a
                prompt of any length, over the context too, is counted, not refused.

        Raises:
            APIError: as `plan`.
            InvalidRequest: a message or tool the template or tokenizer refuses.
        """
        model = self.resolve_model(request.model)
        self._check_task("generate", endpoint)
        await self._check_common(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self._check_logprobs(request.top_logprobs, "top_logprobs")
        tool_parser = self._tool_parser(request)
        if request.continue_final_message and request.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs a final assistant message to continue",
                "continue_final_message",
            )
        template_kwargs = request.template_kwargs(self.tokenizer.special_tokens)
        text = await self.inputs.render_chat_async(
            request.template_messages(),
            tools=request.template_tools(),
            continue_final_message=request.continue_final_message,
            template_kwargs=template_kwargs,
            fold_late_system=request.translated.fold_late_system,
        )
        requested = request.max_completion_tokens or request.max_tokens
        if count_only:  # counted as it is: no check against the context
            prompt_ids = await self.inputs.tokenize_async(text, "messages", special_tokens=False)
            max_tokens = 1
        else:
            prompt_ids = await self.inputs.encode_async(text, "messages", special_tokens=False)
            param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            max_tokens = self._max_tokens(requested, len(prompt_ids), param, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = reasoning_format(self.reasoning_parser, text, template_kwargs)
        chat_format = make_format(
            self.tokenizer,
            tool_parser,
            parallel_tool_calls=request.parallel_tool_calls,
            reasoning_parser=reasoning.parser if reasoning is not None else None,
        )
        plan = Plan(chat_format, model, num_top_logprobs=logprobs)
        plan.structured_param = request.structured_param
        params = self._params(request, max_tokens, logprobs=logprobs)
        if reasoning is not None:
            params = [self._after_reasoning(p, reasoning) for p in params]
        plan.add_prompt(prompt_ids, params, None)
        return plan

    def _after_reasoning(
        self, params: SamplingParams, reasoning: ReasoningFormat
    ) -> SamplingParams:
        """``params`` with its output constraint (if any) applied after the reasoning part
        of the output, as vLLM applies ``structured_outputs`` with a reasoning parser."""
        constraint = params.structured_output
        if constraint is None:
            return params
        prefix = reasoning.grammar(self.tokenizer.added_token_id)
        if prefix is None:
            return params
        constraint = msgspec.structs.replace(constraint, prefix=prefix)
        return msgspec.structs.replace(params, structured_output=constraint)

    def _map_thinking_switch(self, request: ChatTranslated, chat: ChatCompletionRequest) -> None:
        """Set ``enable_thinking`` in ``chat``'s template variables from the translated
        request's own reasoning switch (Anthropic's ``thinking``, the Responses API's
        ``reasoning.effort``; `thinking_requested`), where the chat template has that
        switch (Qwen3's) and ``chat_template_kwargs`` do not set it already."""
        wanted = thinking_requested(request)
        template = self.tokenizer.chat_template or ""
        if wanted is None or "enable_thinking" not in template:
            return
        kwargs = dict(chat.chat_template_kwargs or {})
        kwargs.setdefault("enable_thinking", wanted)
        chat.chat_template_kwargs = kwargs

    def _tool_parser(self, request: ChatCompletionRequest) -> Callable[[], ToolCallParser] | None:
        """What reads tool calls out of each choice's text (None: plain text).

        Raises:
            APIError: ``tool_choice: "auto"`` on a server without a parser, or with a
                model whose chat template cannot show the tools (400s naming the field).
        """
        choice = request.effective_tool_choice
        if choice == "none":
            return None
        if choice == "required":
            return required_parser
        if request.forced_function is not None:
            return partial(NamedCallParser, request.forced_function)
        if self.tool_call_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default when tools are given) needs a server '
                "started with --enable-auto-tool-choice --tool-call-parser NAME; or send "
                'tool_choice "required", "none" or a named function',
                "tool_choice",
            )
        if self.tokenizer.tool_template is None:
            raise bad_request(
                "this model's chat template cannot show tools to the model; start the "
                "server with a tool-aware --chat-template",
                "tools",
            )
        if request.held_calls_or_answer:  # calls, or an answer held to the format
            names = frozenset(tool.function.name for tool in request.tools or ())
            return partial(make_parser, self.tool_call_parser, names=names, held=True)
        return partial(make_parser, self.tool_call_parser)

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
        plan.response_id = plan.format.new_id()
        plan.created = int(time.time())
        return admission

    def make_choices(self, plan: Plan) -> list[Choice]:
        """One `Choice` (incremental detokenizer and stop strings) per engine request."""
        return [
            Choice(i, self.tokenizer, ids, params, self.eos_token_ids)
            for i, (ids, params) in enumerate(plan.requests)
        ]

    async def _respond(self, plan: Plan, request: GenerationRequest, receive: Receive) -> Response:
        admission = self.admit(plan)
        choices = self.make_choices(plan)
        if request.stream:
            stream = Stream(self.engine, plan, choices, admission)
            return EventStreamResponse(
                lambda emit: stream.run(emit, include_usage=request.include_usage)
            )

        async def collect() -> None:
            await run_choices(self.engine, plan, choices, admission, None)

        if not await self._run_connected(receive, admission, collect, plan.structured_param):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = plan.format.response(plan, choices)
        return JSONResponse(body)

    async def _run_connected(
        self,
        receive: Receive,
        admission: Admission,
        work: Callable[[], Awaitable[None]],
        structured_param: str | None = None,
    ) -> bool:
        """Run ``work`` (a non-streamed response's engine requests) while the client is
        connected; False if it left first. The admission is released either way.

        Raises:
            APIError: the engine failed the requests (`engine_error`).
        """

        async def run() -> bool:
            await work()
            return True

        try:
            return await run_while_connected(receive, run) is not None
        except EngineError as exc:
            raise engine_error(exc, structured_param) from exc
        finally:
            self.engine.release(admission)


def thinking_requested(request: ChatTranslated) -> bool | None:
    """Whether a translated request asks the model to reason, in its API's own terms;
    None when it does not say.

    Anthropic Messages: ``thinking`` of type ``disabled`` is False, ``enabled`` or
    ``adaptive`` True (``output_config.effort`` says how much, not whether: it changes
    nothing here). Responses: ``reasoning.effort`` ``"none"`` is False, any other effort
    True.
    """
    if isinstance(request, MessagesRequest):
        kind = request.thinking.type if request.thinking is not None else None
        if kind == "disabled":
            return False
        return True if kind in ("enabled", "adaptive") else None
    reasoning = getattr(request, "reasoning", None)
    if reasoning is None:
        reasoning = (request.model_extra or {}).get("reasoning")
    if isinstance(reasoning, BaseModel):
        reasoning = reasoning.model_dump()
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is None:
        return None
    return effort != "none"
