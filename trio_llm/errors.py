"""Every exception a user of trio_llm catches: one module, re-exported at the package root.

- `EngineError` and its subclasses: a request that the engine cannot serve (the engine
  died, hung, is restarting or stopping, is overloaded, or refused that one request);
  `EngineStartupError` when the engine fails before it is ready.
- `EngineConfigError`: the engine configuration cannot work with the model.
- `ModelNotFoundError`, `ModelConversionError`: ``--model`` names nothing loadable, or a
  GGUF file that cannot be converted.
- `InvalidRequest`: a request that can never be served as given (a prompt, a parameter);
  it names the parameter at fault. The HTTP server answers it with a 400, the embedding
  API raises it as a `ValueError` (it is one). `ContextLengthError`, one of them: the
  prompt does not fit the context (in the words clients recognise).
- `ChatTemplateError`, `InvalidTextError`: raised by the tokenizer for messages the chat
  template rejects and for text that cannot be tokenized.

This module imports nothing: the engine child, the API server and user code share it.
"""

from __future__ import annotations


class EngineError(Exception):
    """A request cannot be served by the engine (base class)."""


class EngineDeadError(EngineError):
    """The engine core process has exited or failed; nothing more will be generated."""


class EngineShutdownError(EngineError):
    """The server is shutting down; in-flight requests are ended with this."""


class EngineHungError(EngineDeadError):
    """The engine core stopped answering (no heartbeat, or a step ran past its timeout)."""


class EngineRestartingError(EngineError):
    """The engine core is being restarted and was not ready in time; retry later."""


class RequestRejectedError(EngineError):
    """The engine refused this one request (the message says why); others are unaffected."""


class EngineOverloadedError(EngineError):
    """Too many requests are already waiting (``--max-num-waiting-requests``); retry later."""


class EngineStartupError(EngineDeadError):
    """The engine child failed or exited before it was ready."""


class EngineConfigError(Exception):
    """The engine configuration cannot work with this model (e.g. KV cache too small)."""


class ModelNotFoundError(Exception):
    """``--model`` names nothing that can be loaded from local disk."""


class ModelConversionError(Exception):
    """A ``.gguf`` file could not be read and converted (truncated, corrupt, or an
    architecture transformers cannot de-quantize)."""


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class InvalidTextError(ValueError):
    """The text cannot be tokenized (e.g. it holds a lone UTF-16 surrogate)."""


class InvalidRequest(ValueError):
    """A request that cannot be served as given.

    Args:
        message: what is wrong, for the client.
        param: the request field at fault (the API's ``param``), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    #: A short machine-readable code for the API's error body (``code``), or None.
    code: str | None = None


#: `ContextLengthError.code`: OpenAI's code for a request over the context (Codex and
#: LiteLLM read it).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ContextLengthError(InvalidRequest):
    """The prompt, or the prompt with the output asked for, does not fit the context.

    The one home of the wording clients recognise: ``message`` is OpenAI's and vLLM's
    ("This model's maximum context length is N tokens. However, ..."), which LiteLLM
    maps to its ``ContextWindowExceededError``; `anthropic_message` is Anthropic's
    ("prompt is too long: P tokens > M maximum", or "input length and `max_tokens`
    exceed context limit: P + C > N, ..."), which Claude Code parses to compact or to
    lower ``max_tokens``.

    Args:
        max_model_len: the context length (tokens).
        num_prompt_tokens: the prompt's tokens; for a text refused before tokenizing
            (``num_chars`` given), the least number of tokens it can have.
        param: the request field at fault (the prompt's, or the output budget's).
        max_tokens: the output tokens asked for, when it is their sum with the prompt
            that does not fit (``--max-tokens-policy strict``); None when the prompt
            alone leaves no room for output.
        num_chars: the text's characters, when it was refused without tokenizing.
        prompt_name: how the message calls the prompt ("messages", "prompt").
    """

    code = CONTEXT_LENGTH_EXCEEDED

    def __init__(
        self,
        max_model_len: int,
        num_prompt_tokens: int,
        param: str | None,
        *,
        max_tokens: int | None = None,
        num_chars: int | None = None,
        prompt_name: str = "messages",
    ) -> None:
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_chars = num_chars
        head = f"This model's maximum context length is {max_model_len} tokens."
        if max_tokens is not None:
            total = num_prompt_tokens + max_tokens
            message = (
                f"{head} However, you requested {total} tokens ({num_prompt_tokens} in the "
                f"{prompt_name}, {max_tokens} in the completion). Please reduce the length of "
                f"the {prompt_name} or completion."
            )
        elif num_chars is not None:
            message = (
                f"{head} However, your request has {num_chars} characters in the "
                f"{prompt_name}, at least {num_prompt_tokens} input tokens. Please reduce the "
                f"length of the {prompt_name}."
            )
        else:
            room = (
                " (at least one token must remain for the output)"
                if num_prompt_tokens == max_model_len
                else ""
            )
            message = (
                f"{head} However, your request has {num_prompt_tokens} input tokens{room}. "
                f"Please reduce the length of the {prompt_name}."
            )
        super().__init__(message, param)

    @property
    def anthropic_message(self) -> str:
        """The message in Anthropic's words (the Messages API's error body)."""
        if self.max_tokens is not None:
            return (
                "input length and `max_tokens` exceed context limit: "
                f"{self.num_prompt_tokens} + {self.max_tokens} > {self.max_model_len}, "
                "decrease input length or `max_tokens` and try again"
            )
        # One token must remain for the output: the longest prompt is one shorter.
        least = "at least " if self.num_chars is not None else ""
        return (
            f"prompt is too long: {least}{self.num_prompt_tokens} tokens > "
            f"{self.max_model_len - 1} maximum"
        )


def first_leaf(exc: BaseException) -> BaseException:
    """``exc`` itself, or the first exception inside it when it is an exception group
    (groups inside groups are opened too): what to report of a nursery's failure."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
