"""Every exception a user of trio_llm catches: one module, re-exported at the package root.

- `EngineError` and its subclasses: a request that the engine cannot serve (the engine
  died, hung, is restarting or stopping, is overloaded, or refused that one request);
  `EngineStartupError` when the engine fails before it is ready.
- `EngineConfigError`: the engine configuration cannot work with the model.
- `ModelNotFoundError`, `ModelConversionError`: ``--model`` names nothing loadable, or a
  GGUF file that cannot be converted.
- `InvalidRequest`: a request that can never be served as given (a prompt, a parameter);
  it names the parameter at fault. The HTTP server answers it with a 400, the embedding
  API raises it as a `ValueError` (it is one).
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


def first_leaf(exc: BaseException) -> BaseException:
    """``exc`` itself, or the first exception inside it when it is an exception group
    (groups inside groups are opened too): what to report of a nursery's failure."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
