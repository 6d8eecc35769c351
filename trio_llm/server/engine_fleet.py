"""One model's engines: the ``--data-parallel-size`` engine children of a `ServerConfig`,
supervised in one nursery, and the request handlers (`ModelServing`) over them.

`run_model` is what the server runs for each model it serves (`trio_llm.server.model_pool`
starts one per loaded model): it starts the engines (`supervise_engines`), loads the
tokenizer (`open_serving`), reports the `ModelServing`, and returns once every engine
has stopped (`EngineHandle.stop`). How an engine failing for good is handled is its
``owner``'s: the server's `trio_llm.server.supervisor.Lifecycle` (a server of one model stops,
exit 1) or the pool's record of the model (the model is marked failed, the others serve
on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Protocol

import trio

from trio_llm.api.chat.serving import ModelServing
from trio_llm.config import EngineConfig
from trio_llm.errors import EngineDeadError, EngineStartupError
from trio_llm.frontend.data_parallel import DataParallelClient
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.engine_process import run_engine_process
from trio_llm.frontend.generation_defaults import load_generation_defaults
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.lora_adapters import LoraAdapters
from trio_llm.lora_files import AdapterError
from trio_llm.server_config import ServerConfig
from trio_llm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineOwner(Protocol):
    """Who learns that a model's engines failed for good (`trio_llm.server.supervisor.Lifecycle`,
    or a model of `trio_llm.server.model_pool.ModelPool`)."""

    def request_stop(self, reason: str, exit_code: int = 0, *, drain: bool = False) -> None:
        """The engines failed for good (``exit_code`` 1), for ``reason``."""
        ...


async def run_model(
    config: ServerConfig,
    owner: EngineOwner,
    *,
    model_name: str | None = None,
    task_status: trio.TaskStatus[ModelServing] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start ``config``'s engines, load the tokenizer, report the `ModelServing` over
    them; return once every engine has stopped (after ``serving.engine.stop``) or failed
    for good (``owner`` learnt why).

    Args:
        model_name: on a server of several models, the name the engines' log lines and
            command lines carry; None on a server of one.

    Raises:
        EngineStartupError: (inside an ExceptionGroup) an engine failed to start.
        OSError: the tokenizer could not be read (the engines are stopped first).
    """
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(
            partial(supervise_engines, config, owner, model_name=model_name)
        )
        engines_ready(engine, config, model_name)
        serving = await open_serving(engine, config)
        task_status.started(serving)


async def supervise_engines(
    config: ServerConfig,
    lifecycle: EngineOwner,
    *,
    model_name: str | None = None,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start ``config.data_parallel_size`` engines at once and supervise each; report one
    `EngineClient`, or a `DataParallelClient` over several, once every engine is ready.

    One engine's failure for good (no restart, or its restarts used up) leaves the others
    serving; ``lifecycle.request_stop`` (exit 1) learns when the last one is gone.

    Raises:
        EngineStartupError: (inside an ExceptionGroup) an engine failed to start.
    """
    size = config.data_parallel_size
    clients: list[EngineClient | None] = [None] * size
    fleet = _Fleet(size, lifecycle)
    configs = [config.engine_for_rank(rank) for rank in range(size)]
    async with trio.open_nursery() as nursery:

        async def start(rank: int) -> None:
            clients[rank] = await nursery.start(
                _supervise_engine, configs[rank], config, rank, fleet.ended, model_name
            )

        async with trio.open_nursery() as starting:
            for rank in range(size):
                starting.start_soon(start, rank)
        ready = [client for client in clients if client is not None]
        fleet.started = True
        if size == 1:
            task_status.started(ready[0])
        else:
            caches = config.engine.cache.enable_prefix_caching
            fleet.group = DataParallelClient(
                ready, prefix_aware=caches and ready[0].info.task == "generate"
            )
            task_status.started(fleet.group)


class _Fleet:
    """How `supervise_engines` learns that an engine stopped for good (`ended`), and
    what follows: a failed start-up, a logged loss, or the owner's stop."""

    def __init__(self, size: int, lifecycle: EngineOwner) -> None:
        self.size = size
        self.lifecycle = lifecycle
        #: Every engine was ready once.
        self.started = False
        #: The handle over several engines (None with one).
        self.group: DataParallelClient | None = None

    def ended(self, rank: int, error: EngineDeadError | None) -> None:
        """Engine ``rank`` stopped for good: after `EngineClient.stop` (None) or failed."""
        if not self.started and error is not None:
            # Ready, then failed while the others were still starting: a failed start-up.
            raise EngineStartupError(f"engine core {rank} failed during start-up: {error}")
        group, lifecycle = self.group, self.lifecycle
        if group is None:
            if error is not None:
                lifecycle.request_stop(f"engine core died: {error}", exit_code=1)
            return
        group.engine_ended()
        if error is None:
            return
        left = group.num_serving + sum(e.is_restarting for e in group.engines)
        if left == 0:
            lifecycle.request_stop(
                f"engine core {rank} died: {error} (no engine left)", exit_code=1
            )
        else:
            logger.error(f"engine core {rank} died: {error}; {left} of {self.size} engines left")


async def _supervise_engine(
    engine_config: EngineConfig,
    config: ServerConfig,
    rank: int,
    ended: Callable[[int, EngineDeadError | None], None],
    model_name: str | None = None,
    *,
    task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run engine ``rank`` (`run_engine_process`) and tell ``ended`` when it stops for good:
    with None after `EngineClient.stop`, with the error when it failed."""
    try:
        await run_engine_process(
            engine_config,
            grace_period=config.shutdown_timeout,
            detokenizer_mode=config.detokenizer_mode,
            step_timeout=config.engine_step_timeout,
            restart=config.restart_policy(),
            data_parallel_rank=None if config.data_parallel_size == 1 else rank,
            model_name=model_name,
            task_status=task_status,
        )
    except EngineStartupError:
        raise  # the first start failed: nothing is serving yet
    except EngineDeadError as exc:
        ended(rank, exc)
    else:
        ended(rank, None)


def engines_ready(
    engine: EngineHandle, config: ServerConfig, model_name: str | None = None
) -> None:
    """Give every engine the stream interval, and log that it is ready (naming
    ``model_name`` on a server of several models)."""
    for rank, client in enumerate(engine.engines):
        client.stream_interval = config.stream_interval
        info = client.info
        name = "engine" if len(engine.engines) == 1 else f"engine {rank}"
        if model_name is not None:
            name += f" of {model_name}"
        logger.info(
            f"{name} ready (pid {info.pid}, {info.dtype}, "
            f"detokenizer {config.detokenizer_mode}, "
            f"max_model_len {info.max_model_len}, "
            f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens, "
            f"engine restart {config.engine_restart})"
        )


async def open_serving(engine: EngineHandle, config: ServerConfig) -> ModelServing:
    """The request handlers over ``engine``: load the tokenizer and generation defaults."""
    tokenizer = await trio.to_thread.run_sync(
        Tokenizer.load, engine.info.model_dir, config.chat_template
    )
    generation_defaults = await trio.to_thread.run_sync(
        load_generation_defaults,
        config.generation_config,
        engine.info.model_dir,
        config.override_generation_config,
    )
    cap = generation_defaults.max_tokens_cap
    if cap is not None:
        logger.info(
            f"every answer is capped at {cap} output tokens (max_new_tokens of the "
            "generation config): one cut there ends with finish_reason length, Messages "
            "stop_reason max_tokens, Responses incomplete (max_output_tokens), whatever "
            "the client's own limit"
        )
    serving = ModelServing(
        engine,
        tokenizer,
        config.model_names(),
        max_tokens_policy=config.max_tokens_policy,
        generation_defaults=generation_defaults,
        max_logprobs=config.max_logprobs,
        max_num_waiting_requests=config.max_num_waiting_requests,
        limits=config.limits,
        request_body_timeout=config.request_body_timeout,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        reasoning_parser=config.reasoning_parser,
        disable_additional_properties=config.disable_additional_properties,
        trust_request_chat_template=config.trust_request_chat_template,
    )
    if config.engine.lora.enable_lora and engine.info.task == "generate":
        serving.adapters = await trio.to_thread.run_sync(
            open_adapters, engine.info.model_dir, config
        )
    return serving


def open_adapters(model_dir: str, config: ServerConfig) -> LoraAdapters:
    """The LoRA adapters served over the model of ``model_dir``: ``--lora-modules``, each
    checked against it (`trio_llm.frontend.lora_adapters`).

    Raises:
        EngineStartupError: an adapter the server cannot serve (the message says why).
    """
    adapters = LoraAdapters(
        model_dir,
        config.engine.lora.max_lora_rank,
        config.allowed_lora_dir if config.allow_runtime_lora_updating else None,
        reserved=config.model_names(),
    )
    for name, path in config.lora_modules:
        try:
            adapters.add(name, path)
        except AdapterError as exc:
            raise EngineStartupError(f"--lora-modules {name}={path}: {exc}") from None
    if config.lora_modules:
        logger.info(f"LoRA adapters: {', '.join(name for name, _ in config.lora_modules)}")
    return adapters
