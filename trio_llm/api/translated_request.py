"""Requests of other APIs served as chat completions (the Responses API, Anthropic
Messages): the base class `ChatTranslated`, which validates the translated body as a
`ChatCompletionRequest` and reports its errors in the other API's field names.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trio_llm.api.chat_request import ChatCompletionRequest
from trio_llm.api.errors import bad_request, validation_message
from trio_llm.api.request_body import RequestBody


class ChatTranslated(RequestBody):
    """A request of another API that is served as a chat completion (`to_chat`): the
    Responses API, Anthropic Messages. Errors found on the chat path are reported in the
    request's own field names (`api_names`)."""

    #: ``(pattern, replacement)`` pairs (regular expressions) from chat field names, as
    #: errors write them, to this API's.
    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = ()

    def to_chat(self) -> ChatCompletionRequest:
        """The chat-completion request this request asks for.

        Raises:
            APIError: a 400 naming the field at fault.
        """
        raise NotImplementedError

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
