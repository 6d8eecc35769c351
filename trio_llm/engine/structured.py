"""Constrained decoding: each request with a `StructuredOutput` gets an llguidance matcher
that says which tokens may come next; the sampler masks the others before sampling (and
before logprobs are taken, so they describe the distribution actually sampled).

The library choice and its figures are in docs/structured-output.md. Grammars are
compiled off the step's path: `GrammarCompiler` owns one worker thread that first builds
llguidance's tokenizer (`GrammarCompiler.start`, called when the engine starts) and then
compiles each new grammar (`GrammarCompiler.compile`: validation, matcher and its first
mask; llguidance releases the GIL while it works). Meanwhile the request waits in the
scheduler's waiting queue, unscheduled. A compiled grammar is kept by its source as a
matcher at its start and each request gets a copy of it (`LLMatcher.deep_copy`, a
fraction of a millisecond), so a repeated schema is compiled once.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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
    """Matchers for `StructuredOutput` constraints over one model's vocabulary, compiled in
    a worker thread.

    Every method is called from the engine's thread (one at a time); only `build` and the
    tokenizer's construction run in the worker thread, which touches nothing else.

    Args:
        tokenizer_dir: the model folder holding ``tokenizer.json`` (llguidance's view of
            it is built in the worker thread, about half a second: see `start`).
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end a constrained output.
    """

    def __init__(
        self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        #: Compiled (or compiling) grammars by kind and source, least recently used first.
        self._compiled: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()

    def start(self) -> None:
        """Begin building llguidance's tokenizer in the worker thread, without waiting for
        it (once; later calls do nothing). The engine calls this when it starts, so the
        first constrained request does not wait for the tokenizer; `compile` calls it too.
        """
        if self._tokenizer is None:
            self._tokenizer = self._submit(self._build_tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (blocks until the worker built it)."""
        self.start()
        assert self._tokenizer is not None
        return self._tokenizer.result()

    def compile(self, spec: StructuredOutput) -> Future[llguidance.LLMatcher]:
        """The grammar of ``spec`` as a matcher at its start, compiled in the worker thread.

        The same future for the same kind and source while it is cached (the last
        `GRAMMAR_CACHE_SIZE` grammars), whether it is done or still compiling; a failed one
        is compiled again when asked for. Each request needs its own copy of the result
        (``deep_copy()``). Never blocks.

        The future's exception is a `StructuredOutputError`: the spec is malformed or uses
        what the library does not implement (an unknown JSON Schema keyword, for example),
        or the tokenizer could not be built; never ignored.
        """
        key = (spec.kind, spec.spec)
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        self.start()
        future = self._submit(self.build, spec)
        self._compiled[key] = future
        if len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``, waiting for its compile (for tools and tests; the
        engine uses `compile`).

        Raises:
            StructuredOutputError: as `compile`'s future.
        """
        return self.compile(spec).result().deep_copy()

    def build(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """Compile ``spec`` into a matcher at its start; the worker thread runs this.

        llguidance compiles lazily; the first mask is asked for here too, so that the
        step that first samples the request does not pay for it (copies share it).

        Raises:
            StructuredOutputError: see `compile`.
        """
        import llguidance

        # `compile` queued the tokenizer's construction first: it is done by now (one thread).
        assert self._tokenizer is not None, "build() runs in the worker, after start()"
        try:
            tokenizer = self._tokenizer.result()
        except Exception as exc:
            raise StructuredOutputError(f"cannot build the grammar tokenizer: {exc}") from exc
        grammar = check_structured_output(spec, tokenizer)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise StructuredOutputError(matcher.get_error())
        llg_numpy = _llguidance_numpy()
        llg_numpy.fill_next_token_bitmask(
            matcher, llg_numpy.allocate_token_bitmask(1, self.vocab_size), 0
        )
        return matcher

    def close(self) -> None:
        """Cancel the compiles not started yet and let the worker thread end after the one
        under way (without waiting for it). Nothing may be compiled afterwards."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self._executor is None:
            # One thread: compiles wait their turn rather than take a core from the step.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._executor.submit(fn, *args)

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance.hf
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
        )


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

    The masks are filled one matcher after another: llguidance's parallel fill (an
    ``LLExecutor``'s threads) was slower on the 2-core machine where the figures are taken
    (docs/structured-output.md).

    Args:
        logits: float32 ``[N, vocab]`` (on any device: the masks are made on the CPU
            and copied over).
        matchers: ``(row, matcher)`` for the constrained rows.
    """
    import torch

    llg_numpy = _llguidance_numpy()
    vocab = logits.shape[-1]
    bitmask = llg_numpy.allocate_token_bitmask(len(matchers), vocab)
    for index, (_, matcher) in enumerate(matchers):
        llg_numpy.fill_next_token_bitmask(matcher, bitmask, index)
    rows = torch.tensor([row for row, _ in matchers], device=logits.device)
    hidden = _disallowed(bitmask, vocab).to(logits.device)
    logits[rows] = logits[rows].masked_fill(hidden, -torch.inf)


def _disallowed(bitmask: Any, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` bool, True where a token is not allowed: token ``t`` is allowed when
    bit ``t % 32`` of word ``t // 32`` of its row of ``bitmask`` (int32 numpy) is set."""
    import numpy as np
    import torch

    words = bitmask.astype("<i4", copy=False)  # little-endian: bit order is token order
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits == 0)


def _llguidance_numpy() -> Any:
    """``llguidance.numpy``: its bitmasks, filled in place.

    Not ``llguidance.torch``: importing it imports ``torch._dynamo`` (seconds, holding the
    GIL), and its ``apply_token_bitmask_inplace`` is a ``torch.compile`` function, seconds
    more of compiling on the step that first samples a constrained request.
    """
    import llguidance.numpy

    return llguidance.numpy
