"""trio_llm: an OpenAI-compatible LLM inference server on Trio structured concurrency.

Run it with ``trio-llm serve``; embed its pieces through the names below.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version

from trio_llm.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from trio_llm.messages import SamplingParams

try:
    #: The installed distribution's version (pyproject.toml), e.g. ``"0.1.0"``.
    __version__: str = _package_version("trio_llm")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_MODEL",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "SamplingParams",
    "SchedulerConfig",
    "ServerConfig",
    "__version__",
]
