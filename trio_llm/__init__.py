"""trio_llm: an OpenAI-compatible LLM inference server on Trio structured concurrency.

Run it with ``trio-llm serve``; embed its pieces through the names below.
"""

from trio_llm.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from trio_llm.messages import SamplingParams

__version__ = "0.1.0"

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
