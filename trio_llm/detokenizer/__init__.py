"""Pure incremental detokenization (no I/O), shared by every process layout."""

from trio_llm.detokenizer.incremental import IncrementalDetokenizer
from trio_llm.detokenizer.stop import StopMatcher

__all__ = ["IncrementalDetokenizer", "StopMatcher"]
