"""Compiling constrained decoding's grammars in the engine: each request with a
`StructuredOutput` gets an llguidance matcher over the model's vocabulary that says which
tokens may come next (the sampler masks the others: `grammar_masks`).

The API process checked the spec already (`trio_llm.structured_output`); here the same
grammar is compiled with the model's tokenizer in a pool of worker threads, off the step's
path; a compile that runs past `GRAMMAR_COMPILE_TIMEOUT` fails its requests. Meanwhile
the request waits in the scheduler's waiting queue, unscheduled. A compiled grammar is
kept by its source as a matcher at its start and each request gets a copy of it
(`LLMatcher.deep_copy`, a fraction of a millisecond), so a repeated schema is compiled
once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.errors import StructuredOutputError, one_line
from trio_llm.structured_output.grammar_check import checked_matcher, default_compile_workers

if TYPE_CHECKING:
    import llguidance

#: Compiled grammars kept (by kind and source).
GRAMMAR_CACHE_SIZE = 256

#: Seconds a grammar may compile in the engine (from the moment a worker starts it)
#: before its requests fail; vLLM's figure for its grammar backends (vllm#54003). The
#: limits of `trio_llm.structured_output.spec_limits` keep every compile measured so far
#: under about 2 s on a 2-core machine, so this is a backstop.
GRAMMAR_COMPILE_TIMEOUT = 10.0


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

    def start(self) -> Future[llguidance.LLTokenizer]:
        """Begin building llguidance's tokenizer in a worker thread, without waiting for
        it (once; later calls return the same build). The engine calls this when it
        starts, so the first constrained request does not wait for the tokenizer;
        `compile` calls it too.

        Returns:
            The build's future.
        """
        if self._tokenizer is None:
            self._tokenizer = self._pool().submit(self._build_tokenizer)
        return self._tokenizer

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (blocks until a worker built it)."""
        return self.start().result()

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
        try:
            tokenizer = self.start().result()
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
        try:
            self.start().result()  # built by another worker; not timed
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
            job.future.set_exception(StructuredOutputError(one_line(str(exc))))
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
