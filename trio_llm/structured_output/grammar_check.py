"""Checking a structured-output grammar: a matcher built over a tokenizer and its first
mask computed (`checked_matcher`), or, in the API process, which has no model tokenizer,
over a 256-byte vocabulary and one step into the grammar (`check_structured_output`);
with llguidance's resource limits (`parser_limits`). Also how many such checks or
compiles a process runs at once (`default_compile_workers`).
"""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING, Any

from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.errors import StructuredOutputError, library_reason, one_line
from trio_llm.structured_output.grammar import grammar_source

if TYPE_CHECKING:
    import llguidance


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits for every grammar here: its own defaults (lexer fuel,
    Earley items per mask, grammar size), with errors that carry no parser state dump."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def default_compile_workers() -> int:
    """Grammar compiles the engine runs at once (and grammar checks the API server runs
    at once): half the cores this process may use, rounded up (vLLM's rule for its
    compile pool): 1 on 2 cores, where a second compile would take the step's own core,
    and more where there are cores to spare."""
    return max(1, (len(os.sched_getaffinity(0)) + 1) // 2)


def check_structured_output(spec: StructuredOutput, tokenizer: Any = None) -> str:
    """llguidance's grammar for ``spec``, checked: built, and its first mask computed,
    over ``tokenizer`` (llguidance's) or, when None (the API process), a 256-byte
    vocabulary that costs nothing to build. Call `spec_limits.check_spec_limits` first.

    Raises:
        StructuredOutputError: malformed, using what llguidance does not implement (a
            warning, such as an unknown JSON Schema keyword, is refused too: never
            silently unenforced), past llguidance's resource limits, or matching no
            string at all.
    """
    grammar = grammar_source(spec)
    if tokenizer is not None:
        checked_matcher(spec, tokenizer, None, grammar=grammar)
        return grammar
    matcher = checked_matcher(spec, _byte_tokenizer(), _BYTE_VOCAB, grammar=grammar)
    _probe(matcher)
    return grammar


def _probe(matcher: llguidance.LLMatcher) -> None:
    """Take one step into the grammar: consume the first byte its first mask allows and
    compute the next mask. Some of llguidance's limits are only met there (a rule of more
    than 2,000 alternatives fills a parser row past ``max_items_in_row``), and a model
    would meet them at its first token.

    Raises:
        StructuredOutputError: the library's reason.
    """
    import numpy as np

    llg_numpy = llguidance_numpy()
    mask = llg_numpy.allocate_token_bitmask(1, _BYTE_VOCAB)
    llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
    bits = np.unpackbits(mask.astype("<i4").view(np.uint8), count=256, bitorder="little")
    allowed = np.flatnonzero(bits)  # the bytes, not the end token
    if not len(allowed):
        return  # only the end: nothing to probe
    if matcher.consume_token(int(allowed[0])):
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
    if matcher.is_error():
        raise StructuredOutputError(library_reason(matcher.get_error()))


def checked_matcher(
    spec: StructuredOutput,
    tokenizer: llguidance.LLTokenizer,
    vocab_size: int | None,
    *,
    grammar: str | None = None,
) -> llguidance.LLMatcher:
    """A matcher for ``spec`` at its start, its first mask computed (``vocab_size`` bits;
    the tokenizer's size when None).

    Raises:
        StructuredOutputError: as `check_structured_output`.
    """
    import llguidance

    if grammar is None:
        grammar = grammar_source(spec)
    # log_level 0: the library's warnings on stderr say what get_error() returns.
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise StructuredOutputError(library_reason(matcher.get_error()))
    warnings = matcher.get_grammar_warnings()
    if warnings:
        raise StructuredOutputError("; ".join(one_line(w) for w in warnings))
    llg_numpy = llguidance_numpy()
    size = vocab_size or tokenizer.vocab_size
    llg_numpy.fill_next_token_bitmask(matcher, llg_numpy.allocate_token_bitmask(1, size), 0)
    if matcher.is_error():
        raise StructuredOutputError(library_reason(matcher.get_error()))
    return matcher


#: The byte vocabulary's size: 256 bytes and an end-of-sequence token.
_BYTE_VOCAB = 257


@cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """An llguidance tokenizer of the 256 bytes and an EOS token (`_BYTE_VOCAB`): any
    grammar's first mask can be computed over it in microseconds, without a model."""
    import llguidance

    class Bytes:
        def __init__(self) -> None:
            self.eos_token_id = 256
            self.bos_token_id = None
            self.tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
            self.special_token_ids = [256]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def llguidance_numpy() -> Any:
    """``llguidance.numpy``: its bitmasks, filled in place.

    Not ``llguidance.torch``: importing it imports ``torch._dynamo`` (seconds, holding the
    GIL), and its ``apply_token_bitmask_inplace`` is a ``torch.compile`` function, seconds
    more of compiling on the step that first samples a constrained request.
    """
    import llguidance.numpy

    return llguidance.numpy
