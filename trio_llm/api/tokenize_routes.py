"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` takes either a completion-style ``prompt`` or chat ``messages`` (rendered with
the model's chat template exactly as ``/v1/chat/completions`` renders them) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` turns token ids back
into text. Neither runs the engine, and neither checks the context length (a client may
ask how long a text is precisely to learn that it is too long). Like vLLM, these routes
live outside ``/v1`` and so are not covered by ``--api-key``; a request without the key
changes nothing of the models (`trio_llm.api.model_router.ModelRouter.acquire_for`): it
is answered by a loaded model, or refused (503 for a model not loaded, 401 for a
``keep_alive``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import trio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

import trio_llm
from trio_llm.api.chat.messages import ChatMessage
from trio_llm.api.chat.request_body import Text, TokenId, refuse_unimplemented
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.body_reading import read_body
from trio_llm.api.http.errors import bad_request, invalid_request
from trio_llm.api.http.parsing import CountedFields
from trio_llm.api.model_router import ModelRouter, hold, peek_model
from trio_llm.errors import InvalidRequest
from trio_llm.frontend.chat_prompt import ChatPrompt

#: Work on more items than this (characters or token ids) runs in a worker thread.
INLINE_LIMIT = 8192

#: vLLM fields of /tokenize this server does not implement; accepted only at these values.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "mm_processor_kwargs": (None, {}),
}


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` or ``messages``.

    ``add_special_tokens`` defaults to true for a prompt (as /v1/completions encodes it)
    and to false for messages (the chat template writes the special tokens itself).
    """

    model_config = ConfigDict(extra="allow")
    COUNTED_FIELDS: ClassVar[CountedFields] = CountedFields(prompt="prompt", messages="messages")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    #: vLLM's: the request's own template (with --trust-request-chat-template only).
    chat_template: Text | None = None

    def check_supported(self) -> None:
        """Raise a 400 for a malformed combination or an unimplemented vLLM field.

        Raises:
            APIError: naming the field.
        """
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of `prompt` or `messages`", "prompt")
        refuse_unimplemented(self.model_extra, _NEUTRAL_VALUES, " yet")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    model: Text | None = None
    tokens: list[TokenId]


#: The OpenAPI ``requestBody`` of both routes: a JSON object (`ModelServing.parse` reads
#: and validates it, limits first and large bodies off the event loop).
_OBJECT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


def tokenize_router(models: ModelRouter) -> APIRouter:
    """The routes ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``: the
    request's ``model`` chooses whose tokenizer and ``max_model_len`` answer (404 for a
    name not served). Every error is an OpenAI-style body (400 for bad input)."""
    router = APIRouter()

    @router.post("/tokenize", openapi_extra=_OBJECT_BODY)
    async def tokenize(http_request: Request) -> JSONResponse:
        serving = await _serving_of(models, http_request)
        tokenizer = serving.tokenizer
        request = await serving.parse(TokenizeRequest, http_request)
        serving.resolve_model(request.model)
        request.check_supported()
        tokens = await _tokens(serving, request)

        def answer() -> bytes:
            token_strs = None
            if request.return_token_strs:
                token_strs = [tokenizer.backend.id_to_token(t) or "" for t in tokens]
            body = {
                "count": len(tokens),
                "max_model_len": serving.max_model_len,
                "tokens": tokens,
                "token_strs": token_strs,
            }
            return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

        # A long text's answer is large (megabytes): build it off the event loop.
        content = answer() if len(tokens) <= INLINE_LIMIT else await trio.to_thread.run_sync(answer)
        return Response(content, media_type="application/json")

    @router.post("/detokenize", openapi_extra=_OBJECT_BODY)
    async def detokenize(http_request: Request) -> JSONResponse:
        serving = await _serving_of(models, http_request)
        tokenizer = serving.tokenizer
        vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        request = await serving.parse(DetokenizeRequest, http_request)
        serving.resolve_model(request.model)
        tokens = request.tokens
        if tokens and max(tokens) >= vocab_size:
            bad = next(t for t in tokens if t >= vocab_size)
            raise bad_request(
                f"token id {bad} is out of range for a vocabulary of {vocab_size}", "tokens"
            )

        def run() -> str:
            return tokenizer.decode(tokens, skip_special_tokens=False)

        text = run() if len(tokens) <= INLINE_LIMIT else await trio.to_thread.run_sync(run)
        return JSONResponse({"prompt": text})

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": trio_llm.__version__})

    return router


async def _serving_of(models: ModelRouter, http_request: Request) -> ModelServing:
    """The handlers of the model the body names, held until the answer is sent (a
    request without the API key: a loaded model's, holding nothing)."""
    raw = await read_body(http_request, models.request_body_timeout)
    name, keep_alive = await peek_model(raw)
    lease = await models.acquire_for(http_request.scope, name, keep_alive)
    hold(http_request.scope, lease)
    return lease.serving


async def _tokens(serving: ModelServing, request: TokenizeRequest) -> list[int]:
    """The token ids of ``request``'s prompt, or of its messages rendered with the chat
    template (the same dicts /v1/chat/completions renders, so the counts agree).

    Raises:
        APIError: 400 for a malformed request or text the tokenizer refuses.
    """
    inputs = serving.inputs
    try:
        if request.prompt is not None:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            return await inputs.tokenize_async(request.prompt, "prompt", special_tokens=special)
        if request.messages is None:  # check_supported refused this already
            raise bad_request("give exactly one of `prompt` or `messages`", "prompt")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        if request.continue_final_message and messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs a final assistant message",
                "continue_final_message",
            )
        chat = ChatPrompt(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            request_template=serving.planner.request_template(request.chat_template),
        )
        text = await inputs.chat_text_async(chat)
        special = bool(request.add_special_tokens)
        return await inputs.tokenize_async(text, "messages", special_tokens=special)
    except InvalidRequest as exc:
        raise invalid_request(exc) from exc
