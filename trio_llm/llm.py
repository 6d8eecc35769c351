"""`LLM`: the engine for synchronous code (scripts, notebooks, offline batches).

    with LLM(max_model_len=2048) as llm:
        for result in llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=16)):
            print(result.text)

An `LLM` runs `trio_llm.async_engine.open_engine` in a Trio event loop of its own, in one
thread named "trio-llm-engine", from construction until `LLM.close`. `LLM.generate`
hands a batch over to that loop, which submits every request at once (so the engine
batches them) and collects the results, while the calling thread waits.

The thread is a daemon only so that a program that forgot `close` can still exit; its
lifetime never depends on that. Without `close`, the engine child dies with this process
all the same: it asked the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG) and
it exits at end-of-file of its socket. Nothing relies on finalizers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import trio

from trio_llm.async_engine import AsyncEngine, Prompt, open_engine, resolve_engine_config
from trio_llm.config import DEFAULT_MODEL
from trio_llm.errors import EngineDeadError, EngineError
from trio_llm.frontend.request_stream import run_all
from trio_llm.frontend.request_timing import EngineStats
from trio_llm.generation import Generation
from trio_llm.messages import EngineReady, SamplingParams, TokenLogprobs
from trio_llm.text.chat_template import read_chat_template
from trio_llm.text.tokenizer import Tokenizer

#: Name of the thread that runs the engine's event loop.
THREAD_NAME = "trio-llm-engine"


@dataclass(frozen=True)
class CompletionResult:
    """The whole output of one prompt.

    Attributes:
        prompt_token_ids: the prompt as the engine saw it (after the chat template).
        text: the generated text (a matched stop string is left out unless
            ``include_stop_str_in_output``).
        token_ids: every generated token id (a stop token included).
        finish_reason: "stop", "length" or "abort".
        stop_reason: the matched stop string or stop token id, else None.
        logprobs: one entry per token behind ``text`` when ``SamplingParams.logprobs``
            is set, else None.
    """

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs] | None


class _Batch:
    """One `LLM.generate` call, shared by the calling thread and the engine's loop."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self.scope = trio.CancelScope()
        self.spawned = False
        self.done = threading.Event()
        self.results: list[CompletionResult] | None = None
        self.error: BaseException | None = None


class LLM:
    """An engine for synchronous code; see the module docstring.

    Args:
        model: a local Hugging Face folder, a ``.gguf`` file, or `DEFAULT_MODEL`.
        detokenizer_mode: "inline" or "process" (see `trio_llm.async_engine.open_engine`).
        shutdown_timeout: seconds the engine gets to exit on `close`.
        chat_template: a Jinja chat template (a file, or the template text) used instead
            of the model's own, as ``--chat-template``.
        **engine_args: keyword arguments of `trio_llm.config.engine_config`.

    Raises:
        TypeError: an unknown engine argument (before anything starts).
        ValueError: a value out of range, or a chat template that is no file and no valid
            Jinja (before anything starts).
        EngineStartupError: the engine failed to start (the model could not be loaded).
        KeyboardInterrupt: while the model loads; the engine is stopped first.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        detokenizer_mode: str = "inline",
        shutdown_timeout: float = 5.0,
        chat_template: str | os.PathLike[str] | None = None,
        **engine_args: Any,
    ) -> None:
        resolve_engine_config(model, detokenizer_mode, shutdown_timeout, engine_args)
        template = read_chat_template(chat_template, "chat_template")
        self._open = lambda: open_engine(
            model,
            detokenizer_mode=detokenizer_mode,
            shutdown_timeout=shutdown_timeout,
            chat_template=template,
            **engine_args,
        )
        self._lock = threading.Lock()
        self._closed = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope = trio.CancelScope()
        self._engine: AsyncEngine | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name=THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            self._ready.wait()
        except BaseException:
            self.close()
            raise
        if self._engine is None:
            self._thread.join()
            error = self._error or RuntimeError("the engine thread ended before it was ready")
            self._error = None
            raise error

    # ------------------------------------------------------------ the engine's thread

    def _thread_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # handed to whoever calls next
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._token = trio.lowlevel.current_trio_token()
        with self._scope:
            async with self._open() as engine, trio.open_nursery() as nursery:
                self._nursery = nursery
                self._engine = engine
                self._ready.set()
                await trio.sleep_forever()

    def _spawn(self, batch: _Batch) -> None:
        """In the engine's thread: start the batch as a task of the engine's nursery."""
        if self._nursery is None or self._closed:
            return
        self._nursery.start_soon(self._run_batch, batch)
        batch.spawned = True

    async def _run_batch(self, batch: _Batch) -> None:
        try:
            with batch.scope:
                batch.results = await _generate_all(batch.generations)
        except Exception as exc:
            batch.error = exc
        finally:
            batch.done.set()

    # ------------------------------------------------------------ public API

    @property
    def info(self) -> EngineReady:
        """The engine's `EngineReady` message (model folder, dtype, KV blocks, pid)."""
        return self._running_engine().info

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self._running_engine().tokenizer

    @property
    def max_model_len(self) -> int:
        """Context length in tokens (prompt + output)."""
        return self._running_engine().max_model_len

    @property
    def stats(self) -> EngineStats:
        """Counters of the engine's steps so far (read by benchmarks)."""
        return self._running_engine().client.stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[CompletionResult]:
        """Generate for every prompt at once; the results in prompt order.

        Args:
            prompts: one prompt or a list of them; a prompt is a text, a list of chat
                messages or a list of token ids (see `trio_llm.async_engine.Prompt`).
                An empty list is an empty batch.
            params: one `SamplingParams` for all prompts, one per prompt, or None for
                ``SamplingParams()``.
            priority: vLLM's: one per prompt, lower handled earlier (with
                ``scheduling_policy="priority"``); None: 0 each.

        Raises:
            TypeError, ValueError: an invalid prompt or parameter (nothing is submitted);
                a list of ``params`` or ``priority`` of another length than ``prompts``.
            EngineDeadError: the engine died (before or during the batch).
            RuntimeError: the `LLM` was closed.
            KeyboardInterrupt: the batch was aborted in the engine, then re-raised.
        """
        batch_prompts = _as_batch(prompts)
        batch_params = _per_prompt(params, len(batch_prompts), "SamplingParams")
        priorities = _per_prompt(priority or 0, len(batch_prompts), "priorities")
        engine = self._running_engine()
        # Checked (and tokenized) here in the calling thread: nothing touches the loop yet.
        generations = [
            engine.generate(prompt, sampling, priority=rank)
            for prompt, sampling, rank in zip(batch_prompts, batch_params, priorities, strict=True)
        ]
        if not generations:
            return []
        batch = _Batch(generations)
        try:
            self._call(self._spawn, batch)
            if batch.spawned:
                batch.done.wait()
        except BaseException:
            # KeyboardInterrupt (or another exception) in this thread: abort the batch.
            self._call(batch.scope.cancel)
            if batch.spawned:
                batch.done.wait()
            raise
        if isinstance(batch.error, EngineDeadError):
            # The engine's supervisor knows more (the exit status): wait for its word.
            self._thread.join()
            raise self._dead_error() from batch.error
        if batch.error is not None:
            raise batch.error
        if batch.results is None:
            # Cancelled from outside the batch: the engine died or close() was called.
            self._thread.join()
            raise self._dead_error()
        return batch.results

    def close(self) -> None:
        """Stop the engine (``shutdown_timeout``, then SIGTERM, SIGKILL) and join its
        thread. Running `generate` calls raise. Idempotent."""
        with self._lock:
            self._closed = True
            token = self._token
        if token is not None:
            try:
                trio.from_thread.run_sync(self._scope.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._engine else "starting"
        return f"<LLM {state}>"

    # ------------------------------------------------------------ helpers

    def _running_engine(self) -> AsyncEngine:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if self._engine is None or not self._thread.is_alive():
            raise self._dead_error()
        return self._engine

    def _dead_error(self) -> BaseException:
        if self._closed:
            return RuntimeError("this LLM is closed")
        error = self._error
        if isinstance(error, EngineError):
            return type(error)(str(error))
        return EngineDeadError(f"the engine stopped: {error!r}" if error else "the engine stopped")

    def _call(self, function: Any, *args: Any) -> None:
        """Run ``function(*args)`` in the engine's thread (nothing if its loop ended)."""
        if self._token is None:
            return
        try:
            trio.from_thread.run_sync(function, *args, trio_token=self._token)
        except trio.RunFinishedError:
            pass


def _per_prompt(value: Any, num_prompts: int, what: str) -> list[Any]:
    """One ``value`` per prompt: a sequence of them as is (its length checked), or the
    same one (a `SamplingParams`, None or an int) for every prompt.

    Raises:
        ValueError: a sequence of another length than ``num_prompts`` (``what`` names
            its items).
    """
    if value is None or isinstance(value, SamplingParams | int):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts")
    return values


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A list of prompts from one prompt or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):
        raise TypeError(
            f"prompts must be a prompt or a list of prompts, not {type(prompts).__name__}"
        )
    if prompts and not isinstance(prompts[0], str | Sequence):
        return [prompts]  # type: ignore[list-item]  # token ids or chat messages
    return list(prompts)  # type: ignore[arg-type]


async def _generate_all(generations: list[Generation]) -> list[CompletionResult]:
    """Submit every generation at once, then collect each to its end, in order.

    Raises:
        EngineError: the first error of any generation (the others are then aborted).
    """
    results: list[CompletionResult | None] = [None] * len(generations)

    async def collect(index: int, generation: Generation) -> None:
        outputs = [output async for output in generation]
        logprobs = None
        if generation.params.logprobs is not None:
            logprobs = [entry for out in outputs for entry in out.logprobs or ()]
        results[index] = CompletionResult(
            prompt_token_ids=generation.prompt_token_ids,
            text="".join(out.text for out in outputs),
            token_ids=[token for out in outputs for token in out.token_ids],
            finish_reason=outputs[-1].finish_reason or "abort",
            stop_reason=outputs[-1].stop_reason,
            logprobs=logprobs,
        )

    async with AsyncExitStack() as stack:
        for generation in generations:
            await stack.enter_async_context(generation)
        await run_all([partial(collect, i, g) for i, g in enumerate(generations)])
    return [result for result in results if result is not None]
