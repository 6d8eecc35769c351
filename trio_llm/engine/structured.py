"""Constrained decoding: each request with a `StructuredOutput` gets an llguidance matcher
that says which tokens may come next; the sampler masks the others before sampling (and
before logprobs are taken, so they describe the distribution actually sampled).

The library choice and its figures are in docs/structured-output.md. Grammars are
compiled when a request is added (llguidance compiles lazily: a few milliseconds for a
100-property schema, the rest as masks are asked for) and kept by their source, so a
repeated schema is compiled once.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trio_llm.messages import StructuredOutput

if TYPE_CHECKING:
    import llguidance
    import torch

#: JSON without optional whitespace (as ``json.dumps(separators=(",", ":"))`` writes it):
#: a model cannot spend its tokens on blank space between the fields.
JSON_DEFAULTS = {"whitespace_flexible": False}

#: Compiled grammars kept (by kind and source).
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be enforced; the message says why."""


class GrammarCompiler:
    """Matchers for `StructuredOutput` constraints over one model's vocabulary.

    Args:
        tokenizer_dir: the model folder holding ``tokenizer.json`` (the tokenizer is
            loaded on the first constrained request, about half a second).
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end a constrained output.
    """

    def __init__(
        self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built once)."""
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf_tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of an output constrained by ``spec``.

        Raises:
            StructuredOutputError: the spec is malformed or uses what the library does not
                implement (an unknown JSON Schema keyword, for example); never ignored.
        """
        import llguidance

        grammar = self._grammar(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise StructuredOutputError(matcher.get_error())
        return matcher

    def _grammar(self, spec: StructuredOutput) -> str:

        key = (spec.kind, spec.spec)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = check_structured_output(spec, self.tokenizer)
        self._grammars[key] = grammar
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar


def check_structured_output(spec: StructuredOutput, tokenizer: Any = None) -> str:
    """llguidance's grammar for ``spec``, checked (with or without the model's tokenizer:
    the API process checks without one, before the request reaches the engine).

    Raises:
        StructuredOutputError: malformed, or using what llguidance does not implement (a
            warning, such as an unknown JSON Schema keyword, is refused too: never
            silently unenforced).
    """
    import llguidance

    try:
        grammar = _grammar_source(spec, llguidance.LLMatcher)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(str(exc)) from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error or messages:
        raise StructuredOutputError("; ".join(messages) or "invalid grammar")
    return grammar


def _grammar_source(spec: StructuredOutput, matcher: Any) -> str:
    """llguidance's grammar text for ``spec``."""
    if spec.kind == "json":
        schema = json.loads(spec.spec)
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON Schema must be an object or a boolean")
        return matcher.grammar_from_json_schema(spec.spec, defaults=JSON_DEFAULTS)
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema(json.dumps({"type": "object"}), JSON_DEFAULTS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        # The text of one choice, unquoted (as vLLM's choice): a Lark rule of literals.
        return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    if spec.kind == "grammar":
        return matcher.grammar_from_lark(spec.spec)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def apply_masks(logits: torch.Tensor, matchers: list[tuple[int, llguidance.LLMatcher]]) -> None:
    """Set to -inf, in place, the logits of tokens each row's matcher does not allow.

    Args:
        logits: float32 ``[N, vocab]`` on the CPU.
        matchers: ``(row, matcher)`` for the constrained rows.
    """
    import torch

    llg_torch = _llguidance_torch()
    bitmask = llg_torch.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for index, (_, matcher) in enumerate(matchers):
        llg_torch.fill_next_token_bitmask(matcher, bitmask, index)
    rows = torch.tensor([row for row, _ in matchers])
    constrained = logits[rows]
    llg_torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits[rows] = constrained


@functools.cache
def _llguidance_torch() -> Any:
    """``llguidance.torch``, imported once without the DeprecationWarning its
    ``torch.jit.script`` kernel raises on this torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import llguidance.torch

    return llguidance.torch
