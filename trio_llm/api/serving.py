"""The OpenAI completion and chat-completion handlers: prompt -> engine -> text.

Both routes share one path: validate and tokenize, then either collect the whole text
(one JSON body) or stream chunks as server-sent events ending with ``data: [DONE]``. The
response shapes follow the OpenAI API reference (``text_completion``, ``chat.completion``,
``chat.completion.chunk``); an error during a stream is sent as a ``data: {"error": ...}``
event followed by ``[DONE]``, as vLLM does.
"""

from __future__ import annotations

import json
import time
import traceback
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from trio_llm.api.disconnect import Emit, EventStreamResponse, run_while_connected
from trio_llm.api.errors import APIError, bad_request, error_body
from trio_llm.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from trio_llm.detokenizer import IncrementalDetokenizer
from trio_llm.frontend.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    RequestRejectedError,
)
from trio_llm.frontend.tokenizer import ChatTemplateError, InvalidTextError, Tokenizer
from trio_llm.messages import SamplingParams

#: HTTP status for a request whose client disconnected (nginx's convention; never seen).
CLIENT_CLOSED_REQUEST = 499

#: Texts shorter than this (characters) are tokenized on the event loop (well under 1 ms).
INLINE_ENCODE_CHARS = 8192


def engine_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine-side failure of one request."""
    if isinstance(exc, RequestRejectedError):
        return bad_request(str(exc))
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), type="service_unavailable_error")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"engine core died: {exc}", type="server_error")
    return APIError(500, str(exc), type="server_error")


@dataclass
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETION = _Kind("cmpl", "text_completion", "text_completion", chat=False)
CHAT = _Kind("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


class OpenAIServing:
    """Serves completions and chat completions with one engine and tokenizer.

    Args:
        engine: the running engine's client.
        tokenizer: the model's tokenizer (with chat template).
        model_names: names accepted in the ``model`` field; the first is the default.
    """

    def __init__(
        self, engine: EngineClient, tokenizer: Tokenizer, model_names: tuple[str, ...]
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size

    # ------------------------------------------------------------ validation

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

    def resolve_max_tokens(self, requested: int | None, num_prompt: int, param: str) -> int:
        """Output budget within the context; 400 when prompt (+ requested output) won't fit."""
        if num_prompt >= self.max_model_len:
            raise bad_request(
                f"the prompt has {num_prompt} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must remain for the output",
                "messages" if param == "max_completion_tokens" else "prompt",
            )
        room = self.max_model_len - num_prompt
        if requested is None:
            return room
        if requested > room:
            raise bad_request(
                f"{param}={requested} plus the prompt's {num_prompt} tokens exceeds this "
                f"model's context of {self.max_model_len} tokens (at most {room} output tokens)",
                param,
            )
        return requested

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}", param
            )

    def _prepare(
        self, request: GenerationRequest, prompt_ids: list[int], requested: int | None, param: str
    ) -> SamplingParams:
        request.check_supported()
        if request.stop_token_ids:
            self._check_token_ids(request.stop_token_ids, "stop_token_ids")
        max_tokens = self.resolve_max_tokens(requested, len(prompt_ids), param)
        return request.sampling_params(max_tokens)

    # ------------------------------------------------------------ routes

    async def completions(self, request: CompletionRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/completions``."""
        model = self.resolve_model(request.model)
        if not request.prompt:
            raise bad_request("the prompt is empty", "prompt")
        if isinstance(request.prompt, str):
            prompt_ids = await self._encode(request.prompt, "prompt", special_tokens=True)
        else:
            self._check_token_ids(request.prompt, "prompt")
            prompt_ids = list(request.prompt)
        if not prompt_ids:
            raise bad_request("the prompt has no tokens", "prompt")
        params = self._prepare(request, prompt_ids, request.max_tokens, "max_tokens")
        return await self._respond(COMPLETION, model, request, prompt_ids, params, receive)

    async def chat(self, request: ChatCompletionRequest, receive: Receive) -> Response:
        """Handle ``POST /v1/chat/completions``."""
        model = self.resolve_model(request.model)
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.render_chat(messages)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from exc
        prompt_ids = await self._encode(text, "messages", special_tokens=False)
        requested = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        params = self._prepare(request, prompt_ids, requested, param)
        return await self._respond(CHAT, model, request, prompt_ids, params, receive)

    async def _encode(self, text: str, param: str, *, special_tokens: bool) -> list[int]:
        """Tokenize without stalling other requests; 400 for text that cannot fit or encode."""
        if self.tokenizer.surely_longer_than(text, self.max_model_len):
            raise bad_request(
                f"the {param} has {len(text)} characters, far more than this model's context "
                f"of {self.max_model_len} tokens",
                param,
            )
        encode = partial(self.tokenizer.encode, text, add_special_tokens=special_tokens)
        try:
            if len(text) < INLINE_ENCODE_CHARS:
                return encode()
            # The tokenizer releases the GIL: other requests keep streaming meanwhile.
            return await trio.to_thread.run_sync(encode)
        except InvalidTextError as exc:
            raise bad_request(str(exc), param) from exc

    # ------------------------------------------------------------ generation

    async def _respond(
        self,
        kind: _Kind,
        model: str,
        request: GenerationRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        receive: Receive,
    ) -> Response:
        if not self.engine.is_alive:
            raise engine_error(
                self.engine.error or EngineShutdownError("the server is shutting down")
            )
        response_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            stream = _Stream(self, kind, response_id, created, model, prompt_ids, params)
            return EventStreamResponse(
                lambda emit: stream.run(emit, include_usage=request.include_usage)
            )

        async def collect() -> tuple[str, str, int]:
            detokenizer = IncrementalDetokenizer(self.tokenizer.backend, prompt_ids)
            finish_reason = "abort"
            async with self.engine.open_request(prompt_ids, params) as tokens:
                async for delta in tokens:
                    finished = delta.finish_reason is not None
                    detokenizer.add_tokens(delta.token_ids, finished=finished)
                    if finished:
                        finish_reason = delta.finish_reason
            return detokenizer.text, finish_reason, len(detokenizer.output_token_ids)

        try:
            result = await run_while_connected(receive, collect)
        except EngineError as exc:
            raise engine_error(exc) from exc
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, finish_reason, num_output = result
        if kind.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {
            "id": response_id,
            "object": kind.object,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), num_output),
        }
        return JSONResponse(body)


def _usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


@dataclass
class _Stream:
    """One streamed response: every chunk carries the same ``id``, ``created`` and ``model``."""

    serving: OpenAIServing
    kind: _Kind
    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": self.kind.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return json.dumps(body, ensure_ascii=False)

    def _choice(self, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict:
        if self.kind.chat:
            delta: dict[str, str] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    async def run(self, emit: Emit, *, include_usage: bool) -> None:
        """Emit every chunk, then ``[DONE]``; an engine error becomes an error event."""
        engine = self.serving.engine
        detokenizer = IncrementalDetokenizer(self.serving.tokenizer.backend, self.prompt_ids)
        try:
            if self.kind.chat:
                await emit(self._chunk([self._choice("", None, role=True)]))
            async with engine.open_request(self.prompt_ids, self.params) as tokens:
                async for delta in tokens:
                    finished = delta.finish_reason is not None
                    text = detokenizer.add_tokens(delta.token_ids, finished=finished)
                    if text or finished:
                        content = text if text or not self.kind.chat else None
                        await emit(self._chunk([self._choice(content, delta.finish_reason)]))
            if include_usage:
                usage = _usage(len(self.prompt_ids), len(detokenizer.output_token_ids))
                await emit(self._chunk([], usage))
        except EngineError as exc:
            error = engine_error(exc)
            await emit(json.dumps(error_body(error.message, error.type, error.param, error.code)))
        except Exception as exc:  # a bug: still end the stream properly, and say so
            traceback.print_exc()
            message = f"internal error: {type(exc).__name__}: {exc}"
            await emit(json.dumps(error_body(message, "server_error")))
        await emit("[DONE]")
