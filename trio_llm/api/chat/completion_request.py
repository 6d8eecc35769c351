"""The body of ``POST /v1/completions``: a prompt (text or token ids) to continue."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import Field, StrictBool, StrictInt

from trio_llm.api.chat.generation_request import GenerationRequest
from trio_llm.api.chat.request_body import INT32_MAX, Text, TokenId
from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.parsing import CountedFields


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings (a batch), a list of token ids, or a list of
    lists of token ids (a batch). ``max_tokens`` defaults to 16 (OpenAI's and vLLM's
    default) and may be 0 only with ``echo``. ``prompt_logprobs`` (vLLM's) reports each
    prompt token's logprob and that many alternatives in the non-streamed response.
    """

    COUNTED_FIELDS: ClassVar[CountedFields] = dataclasses.replace(
        GenerationRequest.COUNTED_FIELDS, prompt="prompt"
    )

    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    suffix: Text | None = None

    def check_supported(self) -> None:
        """As `GenerationRequest.check_supported`; tools are a chat feature (a 400 here).

        Raises:
            APIError: naming the field.
        """
        super().check_supported()
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice"):
            if extra.get(name) not in (None, [], "none"):
                raise bad_request(f"`{name}` is only supported on /v1/chat/completions", name)
