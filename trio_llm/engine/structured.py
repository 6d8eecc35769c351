"""Constrained decoding: each request with a `StructuredOutput` gets an llguidance matcher
that says which tokens may come next; the sampler masks the others before sampling (and
before logprobs are taken, so they describe the distribution actually sampled).

The library choice and its figures are in docs/structured-output.md. A spec passes three
gates, cheapest first:

1. `check_spec_limits`: sizes and counts on the spec's text (the API process, before any
   grammar work), so an oversized spec costs a scan of its text before its 400.
2. `check_structured_output`: the grammar is built and its first mask computed over a
   256-byte vocabulary (the API process has no model tokenizer), with llguidance's own
   resource limits (`parser_limits`); a grammar that fails, or that no finite string
   matches (`start: start`, a ``$ref`` cycle: `unsatisfiable_reason`), is refused.
3. `GrammarCompiler`: the same with the model's vocabulary, in the engine, in a pool of
   worker threads, off the step's path; a compile that runs past `GRAMMAR_COMPILE_TIMEOUT`
   fails its requests.

Meanwhile the request waits in the scheduler's waiting queue, unscheduled. A compiled
grammar is kept by its source as a matcher at its start and each request gets a copy of
it (`LLMatcher.deep_copy`, a fraction of a millisecond), so a repeated schema is
compiled once.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from trio_llm.engine.spec_checks import (
    SpecLimitError,
    StructuredOutputError,
    check_spec_limits,
    unsatisfiable_reason,
    without_vacuous_keywords,
)
from trio_llm.messages import StructuredOutput

__all__ = [
    "GRAMMAR_COMPILE_TIMEOUT",
    "GrammarCompile",
    "GrammarCompiler",
    "SpecLimitError",
    "StructuredOutputError",
    "apply_masks",
    "check_spec_limits",
    "check_structured_output",
    "unsatisfiable_reason",
]

if TYPE_CHECKING:
    import llguidance
    import torch

#: JSON without optional whitespace (as ``json.dumps(separators=(",", ":"))`` writes it):
#: a model cannot spend its tokens on blank space between the fields.
JSON_DEFAULTS = {"whitespace_flexible": False}

#: Compiled grammars kept (by kind and source).
GRAMMAR_CACHE_SIZE = 256

#: Seconds a grammar may compile in the engine (from the moment a worker starts it)
#: before its requests fail; vLLM's figure for its grammar backends (vllm#54003). The
#: limits below keep every compile measured so far under about 2 s on a 2-core machine,
#: so this is a backstop.
GRAMMAR_COMPILE_TIMEOUT = 10.0

#: What a grammar that no finite string matches is refused with.
MATCHES_NOTHING = "the grammar matches no string: no output could ever complete it"


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits for every grammar here: its own defaults (lexer fuel,
    Earley items per mask, grammar size), with errors that carry no parser state dump."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def default_compile_workers() -> int:
    """Grammar compiles the engine runs at once: half the cores this process may use,
    rounded up (vLLM's rule for its compile pool): 1 on 2 cores, where a second compile
    would take the step's own core, and more where there are cores to spare."""
    return max(1, (len(os.sched_getaffinity(0)) + 1) // 2)


class GrammarCompile:
    """One grammar's compile, shared by every request that waits for it.

    Attributes:
        future: the matcher at the grammar's start, or its `StructuredOutputError` (or
            cancelled, when every request left before a worker took it up).
        started: ``time.monotonic()`` when a worker began it; None while it is queued.
        timed_out: set (from a timer thread) once it has run `GrammarCompiler.timeout`
            seconds without finishing; its requests are then failed.
        waiters: requests waiting for it.
    """

    def __init__(self, key: tuple[str, str, str]) -> None:
        self.key = key
        self.future: Future[llguidance.LLMatcher] = Future()
        self.started: float | None = None
        self.timed_out = False
        self.waiters = 0
        #: The worker pool's future of the compile (cancellable while queued).
        self.pool_future: Future[None] | None = None

    def done(self) -> bool:
        """True once the compile ended (result, error, or cancelled)."""
        return self.future.done()

    def ready(self) -> bool:
        """True once its requests can be handed their outcome: it ended or timed out."""
        return self.timed_out or self.future.done()


class GrammarCompiler:
    """Matchers for `StructuredOutput` constraints over one model's vocabulary, compiled in
    a pool of worker threads.

    Every method is called from the engine's thread (one at a time); only `build` and the
    tokenizer's construction run in the worker threads, which touch nothing else. A
    compile no request waits for any more is cancelled if no worker has begun it (`release`);
    one under way runs to its end (llguidance's compile cannot be interrupted) and its
    grammar is cached.

    Args:
        tokenizer_dir: the model folder holding ``tokenizer.json`` (llguidance's view of
            it is built in a worker thread, about half a second: see `start`).
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end a constrained output.
        num_workers: compiles run at once (`default_compile_workers` when None).
        timeout: seconds a compile may run before its requests fail.
    """

    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        num_workers: int | None = None,
        timeout: float = GRAMMAR_COMPILE_TIMEOUT,
    ) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_workers = num_workers or default_compile_workers()
        self.timeout = timeout
        #: Called from a worker or timer thread when a compile starts, ends or times out
        #: (the engine loop wakes up on it). Must be thread-safe and quick.
        self.on_event: Callable[[], None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        #: Compiled (or compiling) grammars by kind and source, least recently used first.
        self._compiled: OrderedDict[tuple[str, str, str], GrammarCompile] = OrderedDict()
        self._timers: set[threading.Timer] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Begin building llguidance's tokenizer in a worker thread, without waiting for
        it (once; later calls do nothing). The engine calls this when it starts, so the
        first constrained request does not wait for the tokenizer; `compile` calls it too.
        """
        if self._tokenizer is None:
            self._tokenizer = self._pool().submit(self._build_tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (blocks until a worker built it)."""
        self.start()
        assert self._tokenizer is not None
        return self._tokenizer.result()

    def compile(self, spec: StructuredOutput) -> GrammarCompile:
        """The compile of ``spec``'s grammar, counting one more request waiting for it
        (hand it back with `release` if that request leaves first). Never blocks.

        The same compile for the same kind and source while it is cached (the last
        `GRAMMAR_CACHE_SIZE` grammars), whether it is done or still compiling; a failed
        one too (a grammar's failure does not change), unless it was cancelled. Each
        request needs its own copy of the result (``deep_copy()``).

        The future's exception is a `StructuredOutputError`: the spec is malformed, uses
        what the library does not implement (an unknown JSON Schema keyword, for example),
        matches nothing, or the tokenizer could not be built; never ignored.
        """
        key = (spec.kind, spec.spec, spec.prefix)
        job = self._compiled.get(key)
        if job is not None and not job.future.cancelled():
            self._compiled.move_to_end(key)
        else:
            self.start()
            job = GrammarCompile(key)
            self._compiled[key] = job
            job.pool_future = self._pool().submit(self._run, job, spec)
            # Cancelled while queued (`release`): the job's own future follows.
            job.pool_future.add_done_callback(lambda done, job=job: _cancel_if(done, job))
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        job.waiters += 1
        return job

    def release(self, job: GrammarCompile) -> None:
        """One request waiting for ``job`` left (aborted, or it timed out). When none is
        left and no worker has begun the compile, it is cancelled and forgotten."""
        job.waiters -= 1
        if job.waiters > 0 or job.done():
            return
        pending = job.pool_future
        if pending is not None and pending.cancel() and self._compiled.get(job.key) is job:
            del self._compiled[job.key]

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``, waiting for its compile (for tools and tests; the
        engine uses `compile`).

        Raises:
            StructuredOutputError: as `compile`'s future.
        """
        job = self.compile(spec)
        try:
            return job.future.result().deep_copy()
        finally:
            job.waiters -= 1

    def build(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """Compile ``spec`` into a matcher at its start; a worker thread runs this.

        llguidance compiles lazily; the first mask is asked for here too, so that the
        step that first samples the request does not pay for it (copies share it), and
        a grammar that allows nothing at its start is refused.

        Raises:
            StructuredOutputError: see `compile`.
        """
        assert self._tokenizer is not None, "build() runs in a worker, after start()"
        try:
            tokenizer = self._tokenizer.result()
        except Exception as exc:
            raise StructuredOutputError(f"cannot build the grammar tokenizer: {exc}") from exc
        return checked_matcher(spec, tokenizer, self.vocab_size)

    def close(self) -> None:
        """Cancel the compiles not started yet and let the worker threads end after the
        ones under way (without waiting for them). Nothing may be compiled afterwards."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="grammar")
        return self._executor

    def _run(self, job: GrammarCompile, spec: StructuredOutput) -> None:
        """A worker's whole compile of ``job``: wait for the tokenizer, then `build`
        within the time limit, then publish the outcome."""
        assert self._tokenizer is not None
        try:
            self._tokenizer.result()  # built by another worker; its time does not count
        except Exception:
            pass  # build() reports it
        job.started = time.monotonic()
        timer = threading.Timer(self.timeout, self._expire, (job,))
        with self._lock:
            self._timers.add(timer)
        timer.start()
        self._notify()
        try:
            matcher = self.build(spec)
        except StructuredOutputError as exc:
            job.future.set_exception(exc)
        except Exception as exc:  # a bug or the library's own failure: still one line
            job.future.set_exception(StructuredOutputError(_one_line(str(exc))))
        else:
            job.future.set_result(matcher)
        finally:
            timer.cancel()
            with self._lock:
                self._timers.discard(timer)
            self._notify()

    def _expire(self, job: GrammarCompile) -> None:
        """The timer's end: ``job`` ran past the time limit."""
        if not job.done():
            job.timed_out = True
            self._notify()

    def _notify(self) -> None:
        callback = self.on_event
        if callback is not None:
            callback()

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance.hf
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
        )


def _cancel_if(pending: Future[None], job: GrammarCompile) -> None:
    if pending.cancelled():
        job.future.cancel()


# ---------------------------------------------------------------- checks


def check_structured_output(spec: StructuredOutput, tokenizer: Any = None) -> str:
    """llguidance's grammar for ``spec``, checked: built, and its first mask computed,
    over ``tokenizer`` (llguidance's) or, when None (the API process), a 256-byte
    vocabulary that costs nothing to build. Call `check_spec_limits` first.

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

    llg_numpy = _llguidance_numpy()
    mask = llg_numpy.allocate_token_bitmask(1, _BYTE_VOCAB)
    llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
    bits = np.unpackbits(mask.astype("<i4").view(np.uint8), count=256, bitorder="little")
    allowed = np.flatnonzero(bits)  # the bytes, not the end token
    if not len(allowed):
        return  # only the end: nothing to probe
    if matcher.consume_token(int(allowed[0])):
        llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
    if matcher.is_error():
        raise StructuredOutputError(_library_reason(matcher.get_error()))


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
        raise StructuredOutputError(_library_reason(matcher.get_error()))
    warnings = matcher.get_grammar_warnings()
    if warnings:
        raise StructuredOutputError("; ".join(_one_line(w) for w in warnings))
    llg_numpy = _llguidance_numpy()
    size = vocab_size or tokenizer.vocab_size
    llg_numpy.fill_next_token_bitmask(matcher, llg_numpy.allocate_token_bitmask(1, size), 0)
    if matcher.is_error():
        raise StructuredOutputError(_library_reason(matcher.get_error()))
    return matcher


def grammar_source(spec: StructuredOutput) -> str:
    """llguidance's grammar text for ``spec`` (a JSON Schema also goes through
    `unsatisfiable_reason`); with a ``prefix``, the constraint's grammar follows the
    prefix's rule ``reasoning`` (`with_prefix`).

    Raises:
        StructuredOutputError: a malformed spec, or a schema that matches nothing.
    """
    from llguidance import LLMatcher

    if spec.prefix:
        return with_prefix(grammar_source(msgspec.structs.replace(spec, prefix="")), spec.prefix)
    try:
        if spec.kind == "json":
            schema = json.loads(spec.spec)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON Schema must be an object or a boolean")
            reason = unsatisfiable_reason(schema)
            if reason is not None:
                raise ValueError(reason)
            text = spec.spec
            if "propertyNames" in text:
                text = json.dumps(without_vacuous_keywords(schema))
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), JSON_DEFAULTS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            # The text of one choice, unquoted (as vLLM's choice): one lexeme of literals.
            # (Not a rule of them: llguidance's parser holds at most 2,000 items in a row,
            # and a rule of more alternatives fails at the output's first token.)
            alternatives = " | ".join(map(json.dumps, choices))
            return LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
        if spec.kind == "grammar":
            return LLMatcher.grammar_from_lark(spec.spec)
    except (ValueError, TypeError, RecursionError) as exc:
        raise StructuredOutputError(_one_line(str(exc))) from exc
    raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def with_prefix(grammar: str, prefix: str) -> str:
    """llguidance's ``grammar`` (its JSON, or a Lark text) preceded by the Lark rule
    ``reasoning`` that ``prefix`` defines: a top-level Lark grammar
    ``start: reasoning @answer`` in front of the constraint's own grammars, the first of
    them named ``answer`` (llguidance's grammar references)."""
    try:
        top = json.loads(grammar)
    except ValueError:
        top = None
    if not isinstance(top, dict) or "grammars" not in top:  # a Lark grammar's text
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *others = top["grammars"]
    lark = f"start: reasoning @{_ANSWER}\n{prefix}"
    top["grammars"] = [{"lark_grammar": lark}, {**first, "name": _ANSWER}, *others]
    return json.dumps(top)


#: The name of a prefixed constraint's own grammar (`with_prefix`).
_ANSWER = "answer"


# ---------------------------------------------------------------- llguidance's messages

#: llguidance's stop reasons for a matcher that can go no further before its grammar is
#: complete: at the start of a grammar, it matches nothing.
_NO_EXTENSION = ("NoExtension", "NoExtensionBias")

#: A caret line or a source excerpt ("   1 | start: foo") of a syntax error.
_EXCERPT = re.compile(r"\s*(\^+|\d+ \|.*)\s*")

#: The longest library message passed on.
_MAX_REASON_CHARS = 500


def _library_reason(message: str) -> str:
    """llguidance's error as one line for a client (see `_one_line`); a matcher that can
    extend nothing at the grammar's start means the grammar matches nothing."""
    reason = _one_line(message)
    if reason in _NO_EXTENSION:
        return MATCHES_NOTHING
    return reason


def _one_line(message: str) -> str:
    """``message`` without what is the library's business: the parser state (``<state>``),
    a panic's ``<backtrace>``, the ``<non-verbose/>`` marker and syntax errors' source
    excerpts; what remains is joined into one line and shortened."""
    lines = []
    for line in message.strip().splitlines():
        if line.lstrip().startswith("<"):
            break  # a state dump, backtrace or marker: the rest is internals
        if line.strip() and not _EXCERPT.fullmatch(line):
            lines.append(line.strip())
    text = " ".join(lines).rstrip(":;, ") or "invalid grammar"
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


# ---------------------------------------------------------------- masks

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


def matcher_error(matcher: llguidance.LLMatcher) -> str | None:
    """Why ``matcher`` failed (one line, as `StructuredOutputError`), or None if it did not."""
    if not matcher.is_error():
        return None
    return _one_line(matcher.get_error())


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
