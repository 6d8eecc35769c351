"""Embedding the engine in a Trio program: `open_engine` and `AsyncEngine`.

    async with open_engine(model, max_model_len=2048) as engine:
        async with engine.generate("Once upon a time", SamplingParams(max_tokens=32)) as gen:
            async for out in gen:
                print(out.text, end="")

`open_engine` starts the engine-core child (and, with ``detokenizer_mode="process"``, the
detokenizer child) in a nursery it owns, exactly as the server does, and stops and reaps
them when its block is left for any reason. The engine runs in its own process, so the
caller's event loop stays free for its other tasks while tokens are computed.

A `trio_llm.generation.Generation` is one engine request (see there).
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import trio

from trio_llm.config import DEFAULT_MODEL, DETOKENIZER_MODES, EngineConfig, engine_config
from trio_llm.errors import EngineDeadError, first_leaf
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.engine_process import run_engine_process
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.generation import Generation
from trio_llm.messages import EngineReady, SamplingParams, Scheduling
from trio_llm.text.chat_template import read_chat_template
from trio_llm.text.choice import Choice
from trio_llm.text.tokenizer import Tokenizer

#: One prompt: a text (tokenized with the tokenizer's special tokens, like
#: /v1/completions), chat messages ``[{"role": ..., "content": ...}]`` (rendered with the
#: model's chat template, like /v1/chat/completions), or token ids.
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]

#: Keyword arguments `open_engine` passes on to `trio_llm.config.engine_config`.
ENGINE_ARGS = tuple(name for name in inspect.signature(engine_config).parameters if name != "model")


def resolve_engine_config(
    model: str | os.PathLike[str],
    detokenizer_mode: str,
    shutdown_timeout: float,
    engine_args: Mapping[str, Any],
) -> EngineConfig:
    """Check the arguments of `open_engine` (or `trio_llm.LLM`) and build the config.

    Raises:
        TypeError: an argument that `trio_llm.config.engine_config` does not take (named
            in the message), or a ``model`` that is not a string or path.
        ValueError: a value out of range (named in the message).
    """
    unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(
            f"unknown engine argument {unknown[0]!r}; the engine arguments are: "
            f"{', '.join(ENGINE_ARGS)}"
        )
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a model name or a path, not {type(model).__name__}")
    if detokenizer_mode not in DETOKENIZER_MODES:
        raise ValueError(
            f"detokenizer_mode must be one of {DETOKENIZER_MODES}, got {detokenizer_mode!r}"
        )
    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be at least 0 seconds, got {shutdown_timeout!r}")
    return engine_config(os.fspath(model), **engine_args)


class AsyncEngine:
    """A running engine, handed out by `open_engine`; valid inside its block only.

    Attributes (read-only):
        info: the engine's `EngineReady` message (model folder, dtype, KV blocks, pid).
        max_model_len: context length in tokens (prompt + output).
        vocab_size: number of token ids (valid ids are ``0 .. vocab_size - 1``).
        tokenizer: the model's `Tokenizer` (encode, decode, chat template).
        eos_token_ids: ids that end a generation unless ``ignore_eos``.
        client: the low-level `EngineClient` (request counts, engine stats).
    """

    def __init__(self, client: EngineClient, tokenizer: Tokenizer) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._eos_token_ids = frozenset(client.info.eos_token_ids)
        # The embedded API refuses a max_tokens past the room left (documented below)
        # rather than lowering it as the HTTP server does by default.
        self._inputs = InputPreprocessor(
            tokenizer, client.info.max_model_len, client.info.vocab_size, max_tokens_policy="strict"
        )
        self._ids = itertools.count()

    @property
    def info(self) -> EngineReady:
        """The engine's `EngineReady` message."""
        return self._client.info

    @property
    def max_model_len(self) -> int:
        """Context length in tokens (prompt + output)."""
        return self._client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self._client.info.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer and chat template."""
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation unless ``ignore_eos``."""
        return self._eos_token_ids

    @property
    def client(self) -> EngineClient:
        """The low-level `EngineClient` (``stats``, ``num_in_flight``)."""
        return self._client

    @property
    def is_alive(self) -> bool:
        """True until the engine dies or its `open_engine` block starts to end."""
        return self._client.is_alive

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Generation:
        """A `Generation` of ``prompt`` with ``params``, checked but not yet submitted.

        Args:
            prompt: a text, chat messages or token ids (see `Prompt`).
            params: None means ``SamplingParams()`` (16 tokens, temperature 1).
            request_id: a label for the caller (kept as ``Generation.request_id``).
            priority: vLLM's: lower is handled earlier; nonzero only with
                ``scheduling_policy="priority"``.

        Raises:
            TypeError: ``prompt`` or ``params`` of the wrong type.
            ValueError: an empty prompt, a token id outside the vocabulary, text that
                cannot be tokenized, messages the chat template rejects, a prompt that
                leaves no room in the context, ``max_tokens`` more than the room left,
                ``prompt_logprobs`` (not reported here), a parameter out of range, or a
                nonzero ``priority`` under the ``fcfs`` scheduling policy.
        """
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not reported by generate(); leave it None")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, not {type(priority).__name__}")
        scheduling = Scheduling(priority)
        scheduling.validate(self.info.scheduling_policy)
        token_ids = self._prompt_token_ids(prompt)
        self._inputs.output_budget(params.max_tokens, len(token_ids))
        request_id = request_id or f"gen-{next(self._ids)}"
        choice = Choice(0, self._tokenizer, token_ids, params, self._eos_token_ids)
        return Generation(self._client, choice, token_ids, request_id, scheduling)

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return self._inputs.encode(prompt, "prompt", special_tokens=True)
        if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
            raise TypeError(
                "a prompt is a str, a list of chat messages (dicts) or a list of token ids, "
                f"not {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("the prompt is empty")
        if all(isinstance(message, Mapping) for message in prompt):
            messages = [_chat_message(message) for message in prompt]  # type: ignore[arg-type]
            text = self._inputs.chat_text(messages, "prompt")
            return self._inputs.encode(text, "prompt", special_tokens=False, what="chat prompt")
        return self._inputs.check_token_ids(prompt)


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"a chat message needs a non-empty string 'role', got {role!r}")
    if not isinstance(content, str):
        raise ValueError(f"a chat message needs a string 'content', got {type(content).__name__}")
    return dict(message)


class _EngineTask:
    """Runs `run_engine_process` as a nursery task and remembers how it ended (``death``,
    ``done``); ``scope`` is shielded once the engine is up (see `open_engine`)."""

    def __init__(self, config: EngineConfig, detokenizer_mode: str, grace_period: float) -> None:
        self.config = config
        self.detokenizer_mode = detokenizer_mode
        self.grace_period = grace_period
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.death: EngineDeadError | None = None

    async def run(self, *, task_status: trio.TaskStatus[EngineClient]) -> None:
        try:
            with self.scope:
                await run_engine_process(
                    self.config,
                    grace_period=self.grace_period,
                    detokenizer_mode=self.detokenizer_mode,
                    task_status=task_status,
                )
        except EngineDeadError as exc:  # EngineStartupError included
            self.death = exc
            raise
        finally:
            self.done.set()


@asynccontextmanager
async def open_engine(
    model: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    detokenizer_mode: str = "inline",
    shutdown_timeout: float = 5.0,
    chat_template: str | os.PathLike[str] | None = None,
    **engine_args: Any,
) -> AsyncIterator[AsyncEngine]:
    """Start the engine child process(es); yield an `AsyncEngine` once the model is ready.

    Leaving the block for any reason (its end, an exception, a cancellation) tells the
    engine to stop, gives it ``shutdown_timeout`` seconds, then SIGTERM and SIGKILL, and
    reaps it, all shielded from cancellation: nothing is left running afterwards.
    Generations still running are ended with ``EngineShutdownError``.

    Args:
        model: a local Hugging Face folder, a ``.gguf`` file, or `DEFAULT_MODEL`.
        detokenizer_mode: "inline" (text is made in this process) or "process" (in a
            detokenizer child between this process and the engine core).
        shutdown_timeout: seconds the engine gets to exit after being told to stop.
        chat_template: a Jinja chat template (a file, or the template text) used instead
            of the model's own, as ``--chat-template``.
        **engine_args: keyword arguments of `trio_llm.config.engine_config` (``dtype``,
            ``max_model_len``, ``max_num_seqs``, ``num_kv_blocks``, ``kv_cache_memory``,
            ``num_threads``, ``seed``, ...).

    Raises:
        TypeError: an unknown engine argument (before any process starts).
        ValueError: a value out of range, or a chat template that is no file and no valid
            Jinja (before any process starts).
        EngineStartupError: the engine failed to load the model or exited while starting.
        EngineDeadError: the engine died while the block ran; the block is cancelled and
            this plain exception (not a group; its message has the exit status) is raised.
    """
    config = resolve_engine_config(model, detokenizer_mode, shutdown_timeout, engine_args)
    template = read_chat_template(chat_template, "chat_template")
    engine_task = _EngineTask(config, detokenizer_mode, shutdown_timeout)
    try:
        async with trio.open_nursery() as nursery:
            client: EngineClient = await nursery.start(engine_task.run)
            # From here the engine is stopped by the `finally` below, not by cancellation:
            # a cancelled caller still gets a graceful stop (with deadlines).
            engine_task.scope.shield = True
            try:
                tokenizer = await trio.to_thread.run_sync(
                    Tokenizer.load, client.info.model_dir, template
                )
                yield AsyncEngine(client, tokenizer)
            finally:
                with trio.CancelScope(shield=True):
                    await client.stop(shutdown_timeout)
                    await engine_task.done.wait()
    except BaseExceptionGroup as group:
        leaf = _single_error(group, engine_task.death)
        if leaf is None:
            raise
        _raise_alone(leaf)


def _raise_alone(leaf: BaseException) -> NoReturn:
    """Raise ``leaf``, unwrapped from its exception group, with its own ``__context__``
    (not the group it was unwrapped from)."""
    context = leaf.__context__
    try:
        raise leaf
    finally:
        leaf.__context__ = context
        del leaf, context


def _single_error(group: BaseExceptionGroup, death: EngineDeadError | None) -> BaseException | None:
    """The one exception to raise for the nursery's ``group``, or None to keep the group.

    Engine death wins when every other leaf is a `trio.Cancelled` or an `EngineDeadError`
    seen by a generation (the engine task's has the exit status). A group of one is
    unwrapped to its leaf.
    """
    errors = group.split(trio.Cancelled)[1]
    if errors is not None:
        dead, others = errors.split(EngineDeadError)
        if dead is not None and others is None:
            return death if death is not None else first_leaf(dead)
    only: BaseException = group
    while isinstance(only, BaseExceptionGroup) and len(only.exceptions) == 1:
        only = only.exceptions[0]
    return None if isinstance(only, BaseExceptionGroup) else only
