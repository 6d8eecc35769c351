"""Requests of other APIs served as chat completions: the base class `ChatTranslated`.

It is all the chat path knows of such an API: the request translates itself into a
`ChatCompletionRequest` (`to_chat`), names its route (`ENDPOINT`), says whether it asks
the model to reason (`thinking_requested`), and reports the chat path's errors in its own
field names (`api_names`). The API's handlers give the format its answer is written in
(`trio_llm.api.chat.serving.ModelServing.plan_as`). The APIs themselves live in their
own packages (`trio_llm.api.anthropic`, `trio_llm.api.responses`); this package never
names them.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.request_body import RequestBody
from trio_llm.api.http.errors import bad_request, validation_message

#: Counts a chat request's prompt tokens (the planner's `count_prompt_tokens`): what a
#: translation needs when it depends on the prompt's length (Anthropic's context edits).
TokenCounter = Callable[[ChatCompletionRequest], int]


class ChatTranslated(RequestBody):
    """A request of another API that is served as a chat completion (`to_chat`): the
    Responses API, Anthropic Messages. Errors found on the chat path are reported in the
    request's own field names (`api_names`)."""

    #: ``(pattern, replacement)`` pairs (regular expressions) from chat field names, as
    #: errors write them, to this API's.
    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = ()

    #: The route errors about this request name (``/v1/messages``).
    ENDPOINT: ClassVar[str] = ""

    @abstractmethod
    def to_chat(self, count_tokens: TokenCounter | None = None) -> ChatCompletionRequest:
        """The chat-completion request this request asks for.

        Args:
            count_tokens: counts a chat request's prompt tokens, for a translation that
                depends on the prompt's length (None: it is not needed).

        Raises:
            APIError: a 400 naming the field at fault.
        """

    def thinking_requested(self) -> bool | None:
        """Whether this request asks the model to reason, in its API's own terms; None
        when it does not say (the chat template's default then holds)."""
        return None

    def api_names(self, param: str | None, message: str) -> tuple[str | None, str]:
        """An error's ``param`` and message with chat field names put in this API's."""
        for pattern, replacement in self.CHAT_NAMES:
            message = re.sub(pattern, replacement, message)
            if param is not None:
                param = re.sub(rf"^{pattern}$", replacement, param)
        return param, message

    def validated_chat(self, body: dict[str, Any], param: str) -> ChatCompletionRequest:
        """``body`` validated as a `ChatCompletionRequest`; a validation error is a 400
        naming the field (in this API's names; ``param`` when none is named)."""
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            message, named = validation_message(RequestValidationError(exc.errors()))
            named, message = self.api_names(named or param, message)
            raise bad_request(message, named) from exc
