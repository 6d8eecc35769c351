"""Starting and supervising the engine-core child process from a Trio nursery.

    engine = await nursery.start(run_engine_process, engine_config)

`run_engine_process` spawns ``python -m trio_llm.engine`` with one end of a Unix socket
pair, sends the pickled `EngineConfig`, and calls ``task_status.started(client)`` only
after the child answered `EngineReady` (model loaded, warm-up step done). It then routes
the child's outputs until the IPC stream ends. Its ``finally`` always reaps the child:
close the socket (the child exits at end-of-file), wait, SIGTERM, wait, SIGKILL; the
waiting is skipped when the child cannot be expected to leave on its own.

With ``detokenizer_mode="process"`` it also spawns ``python -m trio_llm.detokenizer``
between the two (server <-> detokenizer <-> engine core, two socket pairs): the same
messages flow, the outputs arrive with their text, and both children are reaped the same
way. Either child's death ends the channel (each exits at end-of-file of either side).

With a `RestartPolicy`, a failed child set (dead, or hung: silent for ``step_timeout``
seconds) is reaped and replaced after a backoff, and the same `EngineClient` serves
through the new one; requests that were in flight fail at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys

import cloudpickle
import trio

from trio_llm import ipc
from trio_llm.config import DETOKENIZER_MODES, EngineConfig
from trio_llm.errors import EngineDeadError, EngineHungError, EngineStartupError
from trio_llm.frontend.child_process import ChildProcess
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.spare_engine import engine_command, replenish_spare, take_spare
from trio_llm.messages import EngineFailed, EngineReady
from trio_llm.server_config import RestartPolicy

logger = logging.getLogger(__name__)


def describe_exit(returncode: int | None) -> str:
    """Human words for a child's exit status (negative means killed by that signal)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


class _Children:
    """The processes behind one engine channel: the engine core, and in 3-process mode the
    detokenizer between it and the API server."""

    def __init__(
        self, engine: ChildProcess, detokenizer: ChildProcess | None = None, spare: bool = False
    ) -> None:
        self.engine = engine
        self.detokenizer = detokenizer
        #: Whether the engine was a spare (started ahead; its command line names nothing).
        self.spare = spare

    @property
    def all(self) -> list[ChildProcess]:
        return [self.engine] if self.detokenizer is None else [self.detokenizer, self.engine]

    async def wait(self) -> None:
        for process in self.all:
            await process.wait()

    def describe(self) -> str:
        """Exit status of each process, in words (e.g. "killed by SIGKILL")."""
        if self.detokenizer is None:
            return describe_exit(self.engine.returncode)
        return (
            f"engine core: {describe_exit(self.engine.returncode)}; "
            f"detokenizer: {describe_exit(self.detokenizer.returncode)}"
        )


def _ps_tag(rank: int | None, model_name: str | None) -> list[str]:
    """The arguments a child's command line carries only for ``ps``."""
    tag = [] if rank is None else ["--data-parallel-rank", str(rank)]
    return tag if model_name is None else [*tag, "--served-model-name", model_name]


def _spawn(
    detokenizer_mode: str, rank: int | None = None, model_name: str | None = None
) -> tuple[socket.socket, _Children]:
    """Start the child process(es); return the API server's end of the channel and them.
    Their command lines carry ``rank`` and ``model_name`` where given (`_ps_tag`). A
    single engine with the inline detokenizer takes the spare child where one waits
    (`trio_llm.frontend.spare_engine`; its command line names no model)."""
    if detokenizer_mode not in DETOKENIZER_MODES:
        raise ValueError(f"detokenizer_mode must be one of {DETOKENIZER_MODES}")
    spare = take_spare() if detokenizer_mode == "inline" and rank is None else None
    if spare is not None:
        return spare[0], _Children(spare[1], spare=True)
    parent = str(os.getpid())
    tag = _ps_tag(rank, model_name)
    server_end, first_hop = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    to_close = [first_hop]
    try:
        if detokenizer_mode == "inline":
            engine_fd = first_hop
            detokenizer = None
        else:
            engine_fd, detokenizer_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            to_close += [engine_fd, detokenizer_end]
            fds = (first_hop.fileno(), detokenizer_end.fileno())
            detokenizer = ChildProcess(
                [
                    sys.executable,
                    "-m",
                    "trio_llm.detokenizer",
                    "--api-fd",
                    str(fds[0]),
                    "--engine-fd",
                    str(fds[1]),
                    "--parent-pid",
                    parent,
                    *tag,
                ],
                pass_fds=fds,
            )
        try:
            engine = ChildProcess(
                [*engine_command(engine_fd.fileno()), *tag], pass_fds=(engine_fd.fileno(),)
            )
        except BaseException:
            if detokenizer is not None:
                detokenizer.kill()
            raise
    except BaseException:
        server_end.close()
        raise
    finally:
        for sock in to_close:
            sock.close()
    return server_end, _Children(engine, detokenizer)


async def run_engine_process(
    config: EngineConfig,
    *,
    grace_period: float = 5.0,
    detokenizer_mode: str = "inline",
    step_timeout: float | None = None,
    restart: RestartPolicy | None = None,
    data_parallel_rank: int | None = None,
    model_name: str | None = None,
    task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine-core child (and the detokenizer child) for as long as this task lives.

    Returns normally once `EngineClient.stop` was called and the children went away.
    ``task_status.started(client)`` is called once, when the first child is ready; with
    ``restart`` the same `EngineClient` serves every later child (each on the first's dtype).

    Args:
        config: sent to the engine child, pickled, as the first frame.
        grace_period: seconds between the polite steps of reaping (end-of-file, SIGTERM)
            when a child does not exit by itself.
        detokenizer_mode: "inline" (the caller detokenizes) or "process" (a third
            process between the caller and the engine core detokenizes, and the
            `EngineClient`'s outputs carry text).
        step_timeout: seconds of silence (no heartbeat) or of one step after which the
            engine counts as hung: its requests fail with `EngineHungError` and the
            children are killed. None: no hang detection.
        restart: replace failed (dead or hung) children with backoff, within the policy's
            limits; None: the first failure ends this task with `EngineDeadError`.
        data_parallel_rank: this engine's rank under ``--data-parallel-size`` (None with one
            engine): log lines and errors then name it (``engine core 1``), and so do the
            children's command lines for ``ps`` (and ``model_name``, on a server of several).

    Raises:
        ValueError: an unknown ``detokenizer_mode``.
        EngineStartupError: a child failed or exited before the first `EngineReady`.
        EngineDeadError: a child exited, broke the channel or hung while serving (with
            ``restart``: once more failures than the policy allows came within its window).
    """
    if step_timeout is not None:
        heartbeat = min(config.heartbeat_interval, step_timeout / 4)
        config = dataclasses.replace(config, heartbeat_interval=heartbeat)
    supervision = _Supervision(detokenizer_mode, step_timeout, restart, task_status)
    supervision.rank, supervision.model_name = data_parallel_rank, model_name
    while True:
        try:
            await _run_children(config, grace_period, detokenizer_mode, supervision)
            return
        except EngineDeadError as exc:
            client = supervision.client
            if client is None or restart is None or client.stopping:
                raise
            delay = supervision.count_failure(exc)
            logger.warning(f"{supervision.name} failed: {exc}; restarting it in {delay:g} s")
            with supervision.new_scope():
                await trio.sleep(delay)
            if client.stopping:
                return


class _Supervision:
    """What `run_engine_process` keeps across children: the one `EngineClient` (made when
    the first child is ready, then attached to each later one) and the cancel scope of
    the current child or restart wait, which `EngineClient.stop` reaches through
    `on_stop`: a deadline while a child serves, at once while none does."""

    def __init__(
        self,
        detokenizer_mode: str,
        step_timeout: float | None,
        restart: RestartPolicy | None,
        task_status: trio.TaskStatus[EngineClient],
    ) -> None:
        self.detokenizer_mode = detokenizer_mode
        self.step_timeout = step_timeout
        self.restart = restart
        self.task_status = task_status
        self.client: EngineClient | None = None
        self.scope = trio.CancelScope()
        #: The engine's data-parallel rank, or None with one engine.
        self.rank: int | None = None
        #: The model's name on a server of several models (for ``ps``), or None.
        self.model_name: str | None = None
        #: When the children failed (trio's clock), within the restart policy's window.
        self.failures: list[float] = []

    @property
    def name(self) -> str:
        """How messages name this engine: ``engine core``, or ``engine core 1``."""
        return "engine core" if self.rank is None else f"engine core {self.rank}"

    def count_failure(self, exc: EngineDeadError) -> float:
        """The serving children failed with ``exc``: the backoff (seconds) before the next.

        Raises:
            EngineDeadError: more failures than the restart policy allows came within its
                window; the client gave up with this error.
        """
        restart = self.restart
        if restart is None or self.client is None:
            raise RuntimeError("a failure counted without a restart policy or a client")
        now = trio.current_time()
        self.failures = [t for t in self.failures if now - t < restart.window] + [now]
        if len(self.failures) > restart.max_restarts:
            error = EngineDeadError(
                f"{exc}; gave up after {restart.max_restarts} restarts within {restart.window:g} s"
            )
            self.client.give_up(error)
            raise error from exc
        return restart.backoff(len(self.failures))

    def new_scope(self) -> trio.CancelScope:
        """A fresh scope for the next child or restart wait (cancelled if the client is
        already stopping)."""
        self.scope = trio.CancelScope()
        if self.client is not None and self.client.stopping:
            self.scope.cancel()
        return self.scope

    def on_stop(self, grace_period: float | None) -> None:
        """`EngineClient.stop` was called: end the current scope within ``grace_period``
        seconds, or at once when None."""
        if grace_period is None:
            self.scope.cancel()
        else:
            self.scope.deadline = min(self.scope.deadline, trio.current_time() + grace_period)

    def connect(self, channel: ipc.MessageChannel, info: EngineReady) -> EngineClient:
        """Hand a ready child's channel to the client (made and reported on the first call)."""
        if self.client is None:
            client = EngineClient(
                channel,
                info,
                step_timeout=self.step_timeout,
                restart_wait=None if self.restart is None else self.restart.wait,
                detokenizes=self.detokenizer_mode == "process",
                on_stop=self.on_stop,
            )
            self.client = client
            self.task_status.started(client)
        else:
            self.client.attach(channel, info)
        return self.client


async def _run_children(
    config: EngineConfig, grace_period: float, detokenizer_mode: str, supervision: _Supervision
) -> None:
    """Start one set of children, serve through them until they end, and reap them.

    Returns when the client was stopped; raises `EngineDeadError` (or `EngineStartupError`
    before the child was ready) when they failed.
    """
    server_end, children = _spawn(detokenizer_mode, supervision.rank, supervision.model_name)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(server_end))
    channel = ipc.server_channel(stream)
    # Patience with the children only when the channel ended by itself (they are exiting).
    # After a cancellation (a second signal), a missed stop deadline, a hang or a failed
    # start, escalate at once: a child that is loading, stuck or stopped will not leave
    # on its own.
    patient = False
    client = supervision.client
    scope = supervision.new_scope()
    try:
        with scope:
            tag = _ps_tag(supervision.rank, supervision.model_name) if children.spare else []
            info = await _start(channel, children, config, supervision.rank, tuple(tag))
            replenish_spare()
            client = supervision.connect(channel, info)
            await client.route_outputs()
        if client is None or client.stopping:
            patient = not scope.cancelled_caught
            return
        error = client.error
        if isinstance(error, EngineHungError):
            for process in children.all:
                process.kill()
            await children.wait()
            raise EngineHungError(f"{error} ({children.describe()})")
        patient = True
        with trio.move_on_after(grace_period):
            await children.wait()
        raise EngineDeadError(
            f"{error} ({children.describe()})"
            if error
            else f"engine core exited ({children.describe()})"
        )
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
            async with trio.open_nursery() as nursery:
                for process in children.all:
                    nursery.start_soon(_reap, process, grace_period if patient else 0.0)


async def _start(
    channel: ipc.MessageChannel,
    children: _Children,
    config: EngineConfig,
    rank: int | None,
    ps_tag: tuple[str, ...] = (),
) -> EngineReady:
    if ps_tag:
        config = dataclasses.replace(config, ps_tag=ps_tag)
    try:
        await channel.framed.send_frame(cloudpickle.dumps(config))
        message = await channel.receive()
    except ipc.CHANNEL_BROKEN:
        message = None
    if isinstance(message, EngineReady):
        return message
    await children.wait()
    which = "" if rank is None else f"engine core {rank}: "
    if isinstance(message, EngineFailed):
        raise EngineStartupError(f"{which}{message.message}")
    raise EngineStartupError(f"{which}engine core exited during start-up ({children.describe()})")


#: Seconds between SIGTERM and SIGKILL.
KILL_AFTER = 2.0


async def _reap(process: ChildProcess, grace_period: float) -> None:
    """Wait ``grace_period`` for the child to exit, then SIGTERM, then SIGKILL; reap it."""
    if grace_period > 0:
        with trio.move_on_after(grace_period):
            await process.wait()
    if process.returncode is None:
        process.terminate()
        with trio.move_on_after(KILL_AFTER):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
