"""Request bodies of the OpenAI-compatible routes, validated by pydantic.

Field names and defaults follow the OpenAI API reference; ``top_k``, ``ignore_eos`` and
``stop_token_ids`` are vLLM's extensions. Fields that OpenAI defines but this server does
not implement yet are accepted only at their neutral value, so a client never silently
gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from trio_llm.api.errors import bad_request
from trio_llm.messages import SamplingParams

#: Largest integer accepted where the engine takes a 64-bit or 32-bit value.
INT32_MAX = 2**31 - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


#: OpenAI fields implemented later; accepted only at these neutral values.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    # vLLM's extensions
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "repetition_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "prompt_logprobs": (None, 0),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a final chunk carries the token counts."""

    include_usage: StrictBool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = Field(default=1, ge=1)
    user: StrictStr | None = None

    def check_supported(self) -> None:
        """Raise a 400 for a field this server does not implement (given a non-neutral value).

        Raises:
            APIError: naming the field.
        """
        if self.n != 1:
            raise bad_request("only n=1 is supported", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        extra = self.model_extra or {}
        for name, value in extra.items():
            neutral = _NEUTRAL_VALUES.get(name)
            if neutral is not None and value not in neutral:
                raise bad_request(f"`{name}` is not supported by this server yet", name)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's `SamplingParams` for this request with ``max_tokens`` resolved."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: StrictStr | list[TokenId]
    max_tokens: StrictInt | None = Field(default=16, ge=1, le=INT32_MAX)


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a chat message."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
