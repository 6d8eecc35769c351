"""Pure incremental detokenization (no I/O), shared by every process layout."""

from trio_llm.detokenizer.incremental import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
