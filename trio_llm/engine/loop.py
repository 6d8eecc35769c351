"""The engine-core process's only I/O: read requests, run steps in a worker thread, send outputs.

Trio runs in the child too. One task reads messages from the server as they arrive (also
while a step computes), another applies them between steps and runs `EngineCore.step` in a
worker thread, so the event loop stays responsive. Aborts that arrive during a step take
effect right after it; the server drops any output for a request it already aborted.
A third task sends a `Heartbeat` every ``heartbeat_interval`` seconds saying how long the
current step has been running, so the server can tell a hung engine from a busy one. The
loop itself answers the server's `HealthCheck` messages between steps, which proves that
the reader and the loop work too.

Structured outputs' grammars compile in the engine core's own worker threads. When nothing
else can run, the loop waits for the next message *or* a compile to start, finish or run
past its time limit (`_Wakeup`: the core's callback cancels the wait), so a request
waiting for its grammar is neither forgotten nor polled for.

Unless ``--num-threads N`` fixes the count (`EngineConfig.adapts_threads`; on by default
on the CPU), each CPU step runs on the torch thread count `CpuShare` recommends: one thread
fewer for each core other processes take.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import cloudpickle
import setproctitle
import torch
import trio

from trio_llm import ipc
from trio_llm.config import EngineConfig
from trio_llm.engine.core import EngineCore
from trio_llm.engine.cpu_share import CpuShare
from trio_llm.engine.interface import EngineCoreProtocol
from trio_llm.engine.pooling import PoolingCore, uses_pooling
from trio_llm.engine.prefix_tier import PrefixTier
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    HealthCheck,
    HealthReply,
    Heartbeat,
    PauseRequests,
    ResumeRequests,
    Shutdown,
    StepOutputs,
    ToEngine,
)

logger = logging.getLogger(__name__)


async def run_engine_core(stream: trio.abc.Stream) -> int:
    """Serve one API server over ``stream`` until it says `Shutdown` or closes; exit status.

    The first frame is the pickled `EngineConfig`. The model is then loaded and warmed up
    (in a worker thread) before `EngineReady` is sent. Any failure is reported with
    `EngineFailed` before returning 1.
    """
    channel = ipc.engine_channel(stream)
    try:
        return await _run(channel)
    except BaseException as exc:
        if ipc.channel_closed(exc):
            return 1  # the server closed the channel; nobody to tell
        raise


def select_gpu(rank: int, environ: dict[str, str] | os._Environ[str]) -> str | None:
    """Make the rank-th visible GPU the only one this process sees (before CUDA starts):
    ``CUDA_VISIBLE_DEVICES`` is narrowed to its rank-th entry, or set to ``rank`` when
    unset. Returns why that is impossible, or None."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        return None
    ids = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if rank >= len(ids):
        return (
            f"data-parallel engine {rank} needs GPU number {rank + 1}, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}"
        )
    environ["CUDA_VISIBLE_DEVICES"] = ids[rank]
    return None


async def _run(channel: ipc.MessageChannel[ToEngine]) -> int:
    frame = await channel.framed.receive_frame()
    if frame is None:
        return 0
    config: EngineConfig = cloudpickle.loads(frame)
    if config.ps_tag:
        setproctitle.setproctitle(" ".join([setproctitle.getproctitle(), *config.ps_tag]))
    logger.debug("engine core %d: starting %s", os.getpid(), config.model.model)
    if config.model.device == "cuda" and config.data_parallel_rank:
        problem = select_gpu(config.data_parallel_rank, os.environ)
        if problem is not None:
            await _report_failure(channel, f"engine start-up failed: {problem}")
            return 1
    try:
        core = await trio.to_thread.run_sync(_build_core, config)
    except Exception as exc:
        await _report_failure(channel, f"engine start-up failed: {exc}")
        return 1
    try:
        await channel.send(core.ready_message(os.getpid()))
        share = None
        if config.model.device == "cpu" and config.adapts_threads:
            share = CpuShare(torch.get_num_threads())
        tier = PrefixTier.open(core, config) if isinstance(core, EngineCore) else None
        try:
            await _serve(core, _Outbox(channel, share), config.heartbeat_interval, tier)
        finally:
            if tier is not None:
                tier.close()
    except Exception as exc:
        if ipc.channel_closed(exc):
            raise
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        await _report_failure(channel, message, exc_info=True)
        return 1
    finally:
        core.close()
    return 0


def _build_core(config: EngineConfig) -> EngineCore | PoolingCore:
    if uses_pooling(config.model):
        pooling = PoolingCore.from_config(config)
        pooling.warm_up()
        return pooling
    core = EngineCore.from_config(config)
    # llguidance's tokenizer (about half a second) is built in the grammar worker thread
    # from now on, so the first constrained request does not stall every stream for it.
    core.grammars.start()
    core.warm_up()
    return core


def _step(core: EngineCoreProtocol, threads: int | None) -> StepOutputs:
    """One step in a worker thread, on ``threads`` torch threads (OpenMP's thread count is
    per calling thread, so it is set here)."""
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return core.step()


async def _report_failure(
    channel: ipc.MessageChannel, message: str, *, exc_info: bool = False
) -> None:
    logger.error(message, exc_info=exc_info)
    try:
        await channel.send(EngineFailed(message))
    except ipc.CHANNEL_CLOSED:
        pass


class _Outbox:
    """The engine's sending side: steps and heartbeats take turns on one channel."""

    def __init__(
        self, channel: ipc.MessageChannel[ToEngine], share: CpuShare | None = None
    ) -> None:
        self.channel = channel
        #: Chooses each step's torch thread count (None: leave it as configured).
        self.share = share
        self._lock = trio.Lock()
        #: Monotonic time at which the step now computing started; None between steps.
        self.step_started: float | None = None
        #: The disk tier whose running totals every step's stats carry, or None.
        self.tier: PrefixTier | None = None

    async def send(self, message: StepOutputs | Heartbeat | HealthReply) -> None:
        if self.tier is not None and isinstance(message, StepOutputs):
            message = StepOutputs(message.outputs, self.tier.with_counters(message.stats))
        async with self._lock:
            await self.channel.send(message)

    async def run_step(self, core: EngineCoreProtocol) -> None:
        self.step_started = time.monotonic()
        threads = None
        if self.share is not None:
            before = self.share.threads
            threads = self.share.recommend()
            if threads != before:
                logger.info(
                    "other processes took %.1f of %d cores: %d torch thread(s)",
                    self.share.others or 0.0,
                    self.share.cores,
                    threads,
                )
        try:
            outputs = await trio.to_thread.run_sync(_step, core, threads)
        finally:
            self.step_started = None
        await self.send(outputs)

    async def heartbeats(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            started = self.step_started
            await self.send(Heartbeat(0.0 if started is None else time.monotonic() - started))


class _Wakeup:
    """Ends the loop's wait for a message when a grammar compile starts, finishes or runs
    past its time limit.

    The engine core calls `notify` from a grammar worker (or timer) thread; that cancels the wait
    under way (a memory channel's receive loses nothing when cancelled). A notification
    with no wait under way does nothing: the loop checks `EngineCore.has_work` before
    waiting.
    """

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._scope: trio.CancelScope | None = None

    def notify(self) -> None:
        """Wake the loop if it is waiting (thread-safe)."""
        try:
            self._token.run_sync_soon(self._cancel)
        except trio.RunFinishedError:
            pass  # the loop is gone

    def _cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def receive(
        self, inbox: trio.MemoryReceiveChannel[ToEngine], has_work: Callable[[], bool]
    ) -> ToEngine | None:
        """The next message, or None as soon as ``has_work()`` (a grammar compiled).

        Raises:
            trio.EndOfChannel: the server closed the channel.
        """
        with trio.CancelScope() as self._scope:
            try:
                if has_work():  # compiled before the wait began
                    return None
                return await inbox.receive()
            finally:
                self._scope = None
        return None


async def _serve(
    core: EngineCoreProtocol,
    outbox: _Outbox,
    heartbeat_interval: float,
    tier: PrefixTier | None = None,
) -> None:
    channel = outbox.channel
    outbox.tier = tier
    inbox_send, inbox = trio.open_memory_channel[ToEngine](math.inf)
    wakeup = _Wakeup()
    core.on_grammar_event = wakeup.notify
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_messages, channel, inbox_send)
        nursery.start_soon(outbox.heartbeats, heartbeat_interval)
        reported_idle = True
        while True:
            # Idle: nothing, or only paused requests and requests waiting for a grammar.
            if not core.has_work():
                if not reported_idle:
                    # Aborts and pauses can empty the batch without a step; say so.
                    await outbox.send(StepOutputs([], core.stats()))
                    reported_idle = True
                try:
                    message = await wakeup.receive(inbox, core.has_work)
                except trio.EndOfChannel:
                    break
                if message is not None:
                    if not await _apply(core, outbox, message, tier):
                        break
                    # An abort of a paused request changes the stats without any step:
                    # the next idle turn reports them (a health check changes nothing).
                    reported_idle = reported_idle and isinstance(message, HealthCheck)
            if not await _apply_pending(core, outbox, inbox, tier):
                break
            if core.has_work():
                await outbox.run_step(core)
                if tier is not None:
                    tier.after_step()
                reported_idle = False
        nursery.cancel_scope.cancel()


async def _read_messages(
    channel: ipc.MessageChannel[ToEngine], inbox: trio.MemorySendChannel[ToEngine]
) -> None:
    async with inbox:
        while (message := await channel.receive()) is not None:
            await inbox.send(message)


async def _apply_pending(
    core: EngineCoreProtocol,
    outbox: _Outbox,
    inbox: trio.MemoryReceiveChannel[ToEngine],
    tier: PrefixTier | None = None,
) -> bool:
    """Apply every message already received; False once it is time to exit."""
    while True:
        try:
            message = inbox.receive_nowait()
        except trio.WouldBlock:
            return True
        except trio.EndOfChannel:
            return False
        if not await _apply(core, outbox, message, tier):
            return False


async def _apply(
    core: EngineCoreProtocol, outbox: _Outbox, message: ToEngine, tier: PrefixTier | None = None
) -> bool:
    if isinstance(message, AddRequest):
        if tier is not None:
            await tier.load(message)  # the prompt's blocks on disk, into the KV cache
        rejected = core.add_request(message)
        if rejected is not None:
            await outbox.send(StepOutputs([rejected], core.stats()))
    elif isinstance(message, AbortRequests):
        core.abort(message.request_ids)
    elif isinstance(message, PauseRequests):
        core.pause(message.request_ids)
    elif isinstance(message, ResumeRequests):
        core.resume(message.request_ids)
    elif isinstance(message, HealthCheck):
        await outbox.send(HealthReply(message.seq))
    elif isinstance(message, Shutdown):
        return False
    return True
