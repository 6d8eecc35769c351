"""Starting and supervising the engine-core child process from a Trio nursery.

    engine = await nursery.start(run_engine_process, engine_config)

`run_engine_process` spawns ``python -m trio_llm.engine`` with one end of a Unix socket
pair, sends the pickled `EngineConfig`, and calls ``task_status.started(client)`` only
after the child answered `EngineReady` (model loaded, warm-up step done). It then routes
the child's outputs until the IPC stream ends. Its ``finally`` always reaps the child:
close the socket (the child exits at end-of-file), wait, SIGTERM, wait, SIGKILL; the
waiting is skipped when the child cannot be expected to leave on its own.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

import cloudpickle
import trio

from trio_llm import ipc
from trio_llm.config import EngineConfig
from trio_llm.frontend.child_process import ChildProcess
from trio_llm.frontend.engine_client import EngineClient, EngineDeadError
from trio_llm.messages import EngineFailed, EngineReady


class EngineStartupError(EngineDeadError):
    """The engine child failed or exited before it was ready."""


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


async def run_engine_process(
    config: EngineConfig,
    *,
    grace_period: float = 5.0,
    task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine-core child for as long as this task lives.

    Returns normally once `EngineClient.stop` was called and the child went away.

    Args:
        config: sent to the child, pickled, as the first frame.
        grace_period: seconds between the polite steps of reaping (end-of-file, SIGTERM)
            when the child does not exit by itself.

    Raises:
        EngineStartupError: the child failed or exited before `EngineReady`.
        EngineDeadError: the child exited or broke the channel while serving.
    """
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        command = [
            sys.executable,
            "-m",
            "trio_llm.engine",
            "--ipc-fd",
            str(child_sock.fileno()),
            "--parent-pid",
            str(os.getpid()),
        ]
        process = ChildProcess(command, pass_fds=(child_sock.fileno(),))
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()

    stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent_sock))
    channel = ipc.server_channel(stream)
    # Patience with the child only when its channel ended by itself (it is exiting). After
    # a cancellation (a second signal), a missed stop deadline or a failed start, escalate
    # at once: a child that is loading, stuck or stopped will not leave on its own.
    patient = False
    try:
        client = await _start(channel, process, config)
        task_status.started(client)
        with client.stop_scope:
            await client.route_outputs()
        patient = not client.stop_scope.cancelled_caught
        if not client.stopping:
            with trio.move_on_after(grace_period):
                await process.wait()
            error = client.error
            raise EngineDeadError(
                f"{error} ({describe_exit(process.returncode)})"
                if error
                else f"engine core exited ({describe_exit(process.returncode)})"
            )
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
            await _reap(process, grace_period if patient else 0.0)


async def _start(
    channel: ipc.MessageChannel, process: ChildProcess, config: EngineConfig
) -> EngineClient:
    try:
        await channel.framed.send_frame(cloudpickle.dumps(config))
        message = await channel.receive()
    except (trio.BrokenResourceError, trio.ClosedResourceError, ipc.ProtocolError):
        message = None
    if isinstance(message, EngineReady):
        return EngineClient(channel, message)
    await process.wait()
    if isinstance(message, EngineFailed):
        raise EngineStartupError(message.message)
    raise EngineStartupError(
        f"engine core exited during start-up ({describe_exit(process.returncode)})"
    )


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
