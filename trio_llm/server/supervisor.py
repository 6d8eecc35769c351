"""The root of the process tree: one nursery owns the engine child(ren) and the HTTP server.

Start-up order: engine child (ready = model loaded + warm-up step) -> tokenizer -> bind the
port and print its address. A signal during start-up stops at once.

Shutdown order (docs/shutdown.md has the whole story):

1. Stop accepting: hypercorn closes the listening socket; new requests on open
   connections get 503, /health answers 503.
2. SIGTERM only: drain. Accepted requests run on for up to ``shutdown_timeout`` seconds.
   SIGINT, an engine failure, or a second signal during the drain skip this.
3. Background responses still running are cancelled (left in progress in the store, to
   run again at the next start); every request still open ends with an explicit error
   (SSE error event, 503 JSON body, WebSocket error event), and the engine is told to
   stop.
4. After a last grace for those error events, connections whose client stopped reading
   are shut down in the kernel (`trio_llm.connections`), so nothing can hold the exit.
5. The children are reaped (end-of-file, then SIGTERM, then SIGKILL); exit 0 after a
   signal, 1 after an engine failure. Another signal after step 3 cancels everything at
   once; the children are still reaped.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

import hypercorn.config
import hypercorn.trio
import trio

from trio_llm.api.app import build_app
from trio_llm.api.batch.routes import batch_runner_of
from trio_llm.api.http import connection_guard
from trio_llm.api.responses.handlers import ResponsesAPI
from trio_llm.connections import shutdown_client_connections
from trio_llm.server.engine_fleet import engines_ready, open_serving, supervise_engines
from trio_llm.server.model_catalog import catalog_of
from trio_llm.server.model_pool import ModelPool
from trio_llm.server_config import ServerConfig
from trio_llm.store import ConversationLimits, RetentionPolicy, Store, StoreError, open_store
from trio_llm.store.database import redact

#: Re-exported for the embedders and tests that start engines as the server does.
__all__ = ["Lifecycle", "engines_ready", "open_serving", "serve", "supervise_engines"]

logger = logging.getLogger(__name__)

#: Seconds handlers get to write their final error events before stuck connections are cut.
FINAL_WRITE_GRACE = 1.0


@dataclass
class Lifecycle:
    """Why and how the server stops.

    Attributes:
        exit_code: 0 after a signal, 1 after an engine failure.
        reason: one line saying why the server stopped.
        drain: True when accepted requests may finish first (SIGTERM).
        drain_scope: the drain's wait; a second signal cancels it.
        aborting: set once open requests are being ended; a signal after that cancels
            everything at once.
    """

    stop_requested: trio.Event = field(default_factory=trio.Event)
    serving: bool = False
    exit_code: int = 0
    reason: str = "stopped"
    drain: bool = False
    drain_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    aborting: bool = False

    def request_stop(self, reason: str, exit_code: int = 0, *, drain: bool = False) -> None:
        """Start the shutdown (the first reason wins)."""
        if not self.stop_requested.is_set():
            self.reason = reason
            self.exit_code = exit_code
            self.drain = drain
            self.stop_requested.set()


async def serve(
    config: ServerConfig, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> Lifecycle:
    """Run the server until a signal or an engine failure; return how it ended.

    ``task_status.started(binds)`` reports the bound URLs once the server accepts requests.

    Raises:
        EngineStartupError: (inside an ExceptionGroup) the engine failed to start.
    """
    lifecycle = Lifecycle()
    store = await open_server_store(config)
    try:
        async with trio.open_nursery() as root:
            root.start_soon(_handle_signals, lifecycle, root.cancel_scope)
            if store is not None:
                root.start_soon(store.run_retention)
                root.start_soon(store.run_heartbeat)
            await _serve_engines(config, lifecycle, store, root, task_status)
            root.cancel_scope.cancel()
    finally:
        if store is not None:
            store.close()
    return lifecycle


async def open_server_store(config: ServerConfig) -> Store | None:
    """Open (and migrate) the server's store in a worker thread; None with ``--store-url
    none``.

    Raises:
        StoreError: a malformed ``--store-url``, psycopg missing for PostgreSQL, or a
            database that cannot be opened or is newer than this server (the message
            names ``--store-url``).
    """
    if not config.store.enabled:
        return None
    cache_dir = config.engine.cache_dir()
    url = config.store.resolved_url(cache_dir)
    policy = RetentionPolicy(max_age=config.store.retention, max_bytes=config.store.max_size)
    limits = ConversationLimits(
        config.store.max_conversation_items, config.store.max_conversation_bytes
    )
    try:
        store = await trio.to_thread.run_sync(open_store, url, cache_dir, policy, limits)
    except (ValueError, StoreError) as exc:
        message = str(exc) if "--store-url" in str(exc) else f"--store-url {redact(url)}: {exc}"
        raise StoreError(message) from exc
    logger.info(f"store: {store.database.url}")
    return store


async def _serve_engines(
    config: ServerConfig,
    lifecycle: Lifecycle,
    store: Store | None,
    root: trio.Nursery,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    """Start the models' pool (the default model's engines), then the HTTP server;
    return once both have stopped."""
    async with trio.open_nursery() as engine_nursery:
        pool = ModelPool(config, catalog_of(config), lifecycle)
        pool.store = store
        await engine_nursery.start(pool.run)
        max_background = config.store.max_background_responses or config.engine_slots()
        responses = ResponsesAPI(pool, max_background)
        app = build_app(pool, lambda: not lifecycle.stop_requested.is_set(), config, responses)
        connection_guard.install()  # one connection's protocol error ends only it
        # Background responses: tasks of this nursery, stopped before the engines are.
        await engine_nursery.start(responses.serve_background)
        async with trio.open_nursery() as http_nursery:
            binds = await http_nursery.start(
                partial(
                    hypercorn.trio.serve,
                    app,
                    _hypercorn_config(config),
                    shutdown_trigger=lifecycle.stop_requested.wait,
                )
            )
            port = urlsplit(binds[0]).port or config.port
            root.start_soon(_shut_down, lifecycle, pool, config, port, responses.stop_background)
            lifecycle.serving = True
            names = ", ".join(pool.names())
            # CLI output, not a log line: the bound address, on stdout at every level.
            print(f"trio-llm: serving {names} on {binds[0]}", flush=True)
            task_status.started(binds)
            # Batches (issue 34): the batch runner, from now until the stop.
            batch_runner = batch_runner_of(app)
            if batch_runner is not None:
                http_nursery.start_soon(batch_runner.run_until, lifecycle.stop_requested)
        responses.stop_background()
        await pool.stop(config.shutdown_timeout)


async def _shut_down(
    lifecycle: Lifecycle,
    pool: ModelPool,
    config: ServerConfig,
    port: int,
    stop_background: Callable[[], None],
) -> None:
    """Steps 2-4 of the shutdown order (see the module docstring); ``stop_background``
    cancels the background responses still running before the engines stop (they stay
    in progress in the store, and run again at the next start)."""
    await lifecycle.stop_requested.wait()
    logger.info(f"shutting down: {lifecycle.reason}")
    pool.close_admissions()
    if lifecycle.drain and pool.num_in_flight:
        logger.info(
            f"draining {pool.num_in_flight} requests for up to "
            f"{config.shutdown_timeout:g} s (signal again to skip)"
        )
    if lifecycle.drain:
        with lifecycle.drain_scope:
            lifecycle.drain_scope.deadline = trio.current_time() + config.shutdown_timeout
            await pool.wait_idle()
    left = pool.num_in_flight
    if left:
        logger.warning(f"ending {left} unfinished requests with an error")
    lifecycle.aborting = True
    stop_background()
    await pool.stop(config.shutdown_timeout)
    await trio.sleep(FINAL_WRITE_GRACE)
    cut = shutdown_client_connections(port)
    if cut:
        logger.warning(f"closed {cut} client connections that were not reading")


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
    # Our own shutdown (drain, errors, cutting stuck connections) ends every handler
    # before this; hypercorn's deadline is only a backstop.
    hconfig.graceful_timeout = config.shutdown_timeout + FINAL_WRITE_GRACE + 5.0
    # A burst of connections beyond the listen queue gets SYN cookies, retransmit waits and
    # resets; 2048 (uvicorn's default; the kernel caps it at net.core.somaxconn) queues a
    # burst of a thousand clients (docs/benchmarks.md, soak).
    hconfig.backlog = 2048
    hconfig.accesslog = None
    # hypercorn's own error log: warnings and worse, fewer with --log-level error/critical.
    level = max(logging.WARNING, logging.getLogger("trio_llm").getEffectiveLevel())
    hconfig.loglevel = logging.getLevelName(level)
    # A larger WebSocket message is refused with close code 1009 (see docs/websocket.md).
    hconfig.websocket_max_message_size = config.max_request_body_bytes
    return hconfig


async def _handle_signals(lifecycle: Lifecycle, root: trio.CancelScope) -> None:
    """SIGTERM drains, SIGINT stops at once; a second signal skips the drain, a third (or
    one during start-up) cancels everything."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not lifecycle.serving or lifecycle.aborting:
                lifecycle.request_stop(f"received {name}")
                logger.info(f"received {name}: stopping now")
                root.cancel()
            elif lifecycle.stop_requested.is_set():
                logger.info(f"received {name}: skipping the drain")
                lifecycle.drain_scope.cancel()
            else:
                lifecycle.request_stop(f"received {name}", drain=signum == signal.SIGTERM)
