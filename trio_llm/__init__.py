"""trio_llm: an OpenAI-compatible LLM inference server on Trio structured concurrency.

Run it with ``trio-llm serve``; embed its pieces through the names below: `open_engine`
(an engine inside a Trio program) and `LLM` (an engine for synchronous code) are described
in docs/embedding.md. They are imported on first use, so ``import trio_llm`` stays light.
"""

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import TYPE_CHECKING, Any

from trio_llm.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.errors import (
    ChatTemplateError,
    ContextLengthError,
    EngineConfigError,
    EngineDeadError,
    EngineError,
    EngineHungError,
    EngineOverloadedError,
    EngineRestartingError,
    EngineShutdownError,
    EngineStartupError,
    InvalidRequest,
    InvalidTextError,
    ModelConversionError,
    ModelNotFoundError,
    RequestRejectedError,
)
from trio_llm.messages import SamplingParams, StructuredOutput
from trio_llm.server_config import ServerConfig

if TYPE_CHECKING:
    from trio_llm.async_engine import AsyncEngine, open_engine
    from trio_llm.generation import GenerationOutput
    from trio_llm.llm import LLM, CompletionResult

try:
    #: The installed distribution's version (pyproject.toml), e.g. ``"0.1.0"``.
    __version__: str = _package_version("trio_llm")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "AsyncEngine",
    "CacheConfig",
    "ChatTemplateError",
    "CompletionResult",
    "ContextLengthError",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineError",
    "EngineHungError",
    "EngineOverloadedError",
    "EngineRestartingError",
    "EngineShutdownError",
    "EngineStartupError",
    "GenerationOutput",
    "InvalidRequest",
    "InvalidTextError",
    "ModelConfig",
    "ModelConversionError",
    "ModelNotFoundError",
    "RequestRejectedError",
    "SamplingParams",
    "SchedulerConfig",
    "ServerConfig",
    "StructuredOutput",
    "__version__",
    "open_engine",
]


#: Public names imported on first use: name -> module.
_LAZY = {
    "AsyncEngine": "trio_llm.async_engine",
    "GenerationOutput": "trio_llm.generation",
    "open_engine": "trio_llm.async_engine",
    "LLM": "trio_llm.llm",
    "CompletionResult": "trio_llm.llm",
}


def __getattr__(name: str) -> Any:
    """Import the heavier public names (`open_engine`, `LLM`, ...) when first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
