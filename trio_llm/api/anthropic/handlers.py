"""The Anthropic Messages routes (the route table's owner ``anthropic``): ``POST
/v1/messages`` runs the one chat path in the Messages format; ``POST
/v1/messages/count_tokens`` counts the prompt that request would have."""

from __future__ import annotations

from functools import partial

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from trio_llm.api.anthropic.format import MessagesFormat
from trio_llm.api.anthropic.request import CountTokensRequest, MessagesRequest
from trio_llm.api.chat.serving import ModelServing


class MessagesAPI:
    """The handlers of Anthropic's routes, each given the model's `ModelServing`."""

    async def create(
        self, request: MessagesRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Handle ``POST /v1/messages``: a ``message`` body, or Anthropic's named
        server-sent events with ``stream``.

        Raises:
            APIError: as `ModelServing.plan_as`, naming the Messages fields.
        """
        return await serving.respond_translated(request, receive, MessagesFormat)

    async def count_tokens(
        self, request: CountTokensRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Handle ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, from the
        same validation, template and tokenizer as ``/v1/messages``.

        Raises:
            APIError: as `ModelServing.plan_as`, naming the Messages fields.
        """
        to_chat = partial(request.to_chat, count_tokens=serving.planner.count_prompt_tokens)
        _, plan = await serving.plan_translated(request, MessagesFormat, to_chat, count_only=True)
        return JSONResponse({"input_tokens": sum(plan.prompt_lengths)})
