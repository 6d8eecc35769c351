"""The root of the process tree: one nursery owns the engine child and the HTTP server.

Start-up order: engine child (ready = model loaded + warm-up step) -> tokenizer -> bind the
port and print its address. Shutdown order, whatever triggers it (SIGINT/SIGTERM, or the
engine dying): every in-flight request is ended with an error event or response, the
engine is told to stop, hypercorn stops accepting and waits for handlers to finish
(``shutdown_timeout``), then the engine child is reaped (end-of-file, SIGTERM, SIGKILL).
A second signal cancels everything at once; the child is still reaped.
"""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass, field
from functools import partial

import hypercorn.config
import hypercorn.trio
import trio

from trio_llm.api.app import build_app
from trio_llm.api.serving import OpenAIServing
from trio_llm.config import ServerConfig
from trio_llm.frontend.engine_client import EngineClient, EngineDeadError
from trio_llm.frontend.engine_process import EngineStartupError, run_engine_process
from trio_llm.frontend.tokenizer import Tokenizer


@dataclass
class Lifecycle:
    """Why and how the server stops.

    Attributes:
        exit_code: 0 after a signal, 1 after an engine failure.
        reason: one line saying why the server stopped.
    """

    stop_requested: trio.Event = field(default_factory=trio.Event)
    serving: bool = False
    exit_code: int = 0
    reason: str = "stopped"

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        """Start the shutdown (the first reason wins)."""
        if not self.stop_requested.is_set():
            self.reason = reason
            self.exit_code = exit_code
            self.stop_requested.set()


def _log(message: str) -> None:
    print(f"trio-llm: {message}", file=sys.stderr, flush=True)


async def serve(
    config: ServerConfig, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> Lifecycle:
    """Run the server until a signal or an engine failure; return how it ended.

    ``task_status.started(binds)`` reports the bound URLs once the server accepts requests.

    Raises:
        EngineStartupError: (inside an ExceptionGroup) the engine failed to start.
    """
    lifecycle = Lifecycle()
    async with trio.open_nursery() as root:
        root.start_soon(_handle_signals, lifecycle, root.cancel_scope)
        async with trio.open_nursery() as engine_nursery:
            engine: EngineClient = await engine_nursery.start(_supervise_engine, config, lifecycle)
            _log(
                f"engine ready (pid {engine.info.pid}, {engine.info.dtype}, "
                f"detokenizer {config.detokenizer_mode}, "
                f"max_model_len {engine.info.max_model_len}, "
                f"{engine.info.num_kv_blocks} KV blocks of {engine.info.block_size} tokens)"
            )
            tokenizer = await trio.to_thread.run_sync(Tokenizer.load, engine.info.model_dir)
            serving = OpenAIServing(
                engine,
                tokenizer,
                config.model_names(),
                max_logprobs=config.max_logprobs,
                max_num_waiting_requests=config.max_num_waiting_requests,
            )
            app = build_app(serving, lambda: not lifecycle.stop_requested.is_set(), config)
            async with trio.open_nursery() as http_nursery:
                binds = await http_nursery.start(
                    partial(
                        hypercorn.trio.serve,
                        app,
                        _hypercorn_config(config),
                        shutdown_trigger=partial(_wait_and_stop_engine, lifecycle, engine, config),
                    )
                )
                lifecycle.serving = True
                names = ", ".join(config.model_names())
                print(f"trio-llm: serving {names} on {binds[0]}", flush=True)
                task_status.started(binds)
            await engine.stop(config.shutdown_timeout)
        root.cancel_scope.cancel()
    return lifecycle


def check_bindable(host: str, port: int) -> None:
    """Bind and release ``host:port`` as hypercorn will (SO_REUSEADDR); port 0 always works.

    Raises:
        OSError: the address is in use or not local, with the address in the message.
    """
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def _hypercorn_config(config: ServerConfig) -> hypercorn.config.Config:
    hconfig = hypercorn.config.Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hconfig.bind = [f"{host}:{config.port}"]
    hconfig.graceful_timeout = config.shutdown_timeout
    hconfig.accesslog = None
    hconfig.loglevel = "WARNING"
    # A larger WebSocket message is refused with close code 1009 (see docs/websocket.md).
    hconfig.websocket_max_message_size = config.max_request_body_bytes
    return hconfig


async def _supervise_engine(
    config: ServerConfig,
    lifecycle: Lifecycle,
    *,
    task_status: trio.TaskStatus[EngineClient] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await run_engine_process(
            config.engine,
            grace_period=config.shutdown_timeout,
            detokenizer_mode=config.detokenizer_mode,
            task_status=task_status,
        )
    except EngineStartupError:
        raise
    except EngineDeadError as exc:
        lifecycle.request_stop(f"engine core died: {exc}", exit_code=1)


async def _wait_and_stop_engine(
    lifecycle: Lifecycle, engine: EngineClient, config: ServerConfig
) -> None:
    """Hypercorn's shutdown trigger: end in-flight requests, then let hypercorn drain."""
    await lifecycle.stop_requested.wait()
    _log(f"shutting down: {lifecycle.reason}")
    await engine.stop(config.shutdown_timeout)


async def _handle_signals(lifecycle: Lifecycle, root: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if lifecycle.stop_requested.is_set() or not lifecycle.serving:
                lifecycle.request_stop(f"received {name}")
                _log(f"received {name}: stopping now")
                root.cancel()
            else:
                lifecycle.request_stop(f"received {name}")
