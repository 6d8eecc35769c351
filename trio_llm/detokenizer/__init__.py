"""Incremental detokenization.

``incremental``, ``stop`` and ``output`` are pure (no I/O) and shared by every process
layout; ``process`` is the detokenizer child of 3-process mode (``python -m
trio_llm.detokenizer``), which runs the same `RequestDetokenizer` between the engine
core and the API server.
"""

from trio_llm.detokenizer.incremental import IncrementalDetokenizer
from trio_llm.detokenizer.output import RequestDetokenizer, TextDelta
from trio_llm.detokenizer.stop import StopMatcher

__all__ = ["IncrementalDetokenizer", "RequestDetokenizer", "StopMatcher", "TextDelta"]
