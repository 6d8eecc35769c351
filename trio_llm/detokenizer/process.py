"""The detokenizer child of 3-process mode: between the API server and the engine core.

    API server ──(A: ToEngine / FromEngine)── detokenizer ──(B: same messages)── engine core

It speaks the engine's messages on both sides, so the API server talks to it exactly as
it talks to an engine core. Upstream (A -> B) it forwards every message, registering a
`RequestDetokenizer` for each `AddRequest` first and dropping it on `AbortRequests`, so
the engine's outputs for a request can never arrive before its registration. Downstream
(B -> A) it fills in ``text`` (and ``stop_reason``, with logprobs aligned to the text) of
every `RequestOutput`; a request that hits a stop string is reported finished and aborted
in the engine at once, and later outputs for it are dropped.

Lifetime: the first frame from A (the pickled `EngineConfig`) is passed to B unread; the
tokenizer is loaded once the engine answered `EngineReady` (it names the model folder),
and that message is then passed on. End-of-file on either side ends the process, closing
the other side, so the engine core exits when the detokenizer does and the API server
sees the end of its channel when either child dies.
"""

from __future__ import annotations

import logging

import trio

from trio_llm import ipc
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    FromEngine,
    RequestOutput,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from trio_llm.text.output import RequestDetokenizer
from trio_llm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Detokenizers:
    """The `RequestDetokenizer` of every request in flight (pure; no I/O).

    Args:
        tokenizer: the model's tokenizer.
        eos_token_ids: from `EngineReady`.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestDetokenizer] = {}

    def add(self, request: AddRequest) -> None:
        """Start detokenizing ``request`` (its outputs may arrive from now on)."""
        self.requests[request.request_id] = RequestDetokenizer(
            self.tokenizer.backend, request.prompt_token_ids, request.params, self.eos_token_ids
        )

    def abort(self, request_ids: list[str]) -> None:
        """Forget these requests; their later outputs are dropped."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def process(self, message: StepOutputs) -> tuple[StepOutputs, list[str]]:
        """Fill in the text of every output; returns the message to pass on and the ids
        of requests that a stop string finished (to abort in the engine)."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        for output in message.outputs:
            detokenizer = self.requests.get(output.request_id)
            if detokenizer is None:
                continue  # aborted, or finished by a stop string already
            consumed = detokenizer.num_output_tokens
            delta = detokenizer.process(output.new_token_ids, output.finish_reason, output.logprobs)
            # Tokens after a stop string are not output (nor counted in usage).
            output.new_token_ids = output.new_token_ids[: detokenizer.num_output_tokens - consumed]
            if delta is None:
                output.text = ""
                output.logprobs = [] if output.logprobs is not None else None
            else:
                output.text = delta.text
                if output.logprobs is not None:
                    output.logprobs = delta.logprobs
                output.stop_reason = delta.stop_reason
                if delta.finish_reason is not None and output.finish_reason is None:
                    output.finish_reason = delta.finish_reason
                    stopped.append(output.request_id)
            if output.finish_reason is not None:
                del self.requests[output.request_id]
            outputs.append(output)
        return StepOutputs(outputs, message.stats), stopped


async def run_detokenizer(api_stream: trio.abc.Stream, engine_stream: trio.abc.Stream) -> int:
    """Relay between the API server (``api_stream``) and the engine core; exit status.

    Returns 0 after the engine exited on `Shutdown`, 1 when either side ended otherwise.
    """
    api = ipc.engine_channel(api_stream)
    engine = ipc.server_channel(engine_stream)
    try:
        return await _run(api, engine)
    except BaseException as exc:
        if ipc.channel_closed(exc, ipc.CHANNEL_BROKEN):
            return 1
        raise
    finally:
        with trio.CancelScope(shield=True):
            await engine.aclose()
            await api.aclose()


async def _run(api: ipc.MessageChannel[ToEngine], engine: ipc.MessageChannel[FromEngine]) -> int:
    config_frame = await api.framed.receive_frame()
    if config_frame is None:
        return 0
    await engine.framed.send_frame(config_frame)
    ready = await engine.receive()
    if not isinstance(ready, EngineReady):
        if ready is not None:
            await api.send(ready)  # EngineFailed: the engine's own reason
        return 1
    try:
        tokenizer = await trio.to_thread.run_sync(Tokenizer.load, ready.model_dir)
    except Exception as exc:
        await api.send(EngineFailed(f"detokenizer start-up failed: {exc}"))
        return 1
    await api.send(ready)
    logger.debug("detokenizing for %s", ready.model_dir)
    relay = _Relay(api, engine, Detokenizers(tokenizer, ready.eos_token_ids))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.upstream, nursery.cancel_scope)
        nursery.start_soon(relay.downstream, nursery.cancel_scope)
    return relay.exit_code


class _Relay:
    def __init__(
        self,
        api: ipc.MessageChannel[ToEngine],
        engine: ipc.MessageChannel[FromEngine],
        detokenizers: Detokenizers,
    ) -> None:
        self.api = api
        self.engine = engine
        self.detokenizers = detokenizers
        self.engine_lock = trio.Lock()  # both directions send to the engine
        self.shutting_down = False
        self.exit_code = 1

    async def send_to_engine(self, message: ToEngine) -> None:
        async with self.engine_lock:
            await self.engine.send(message)

    async def upstream(self, done: trio.CancelScope) -> None:
        """API server -> engine core, until the server closes its end."""
        try:
            while (message := await self.api.receive()) is not None:
                if isinstance(message, AddRequest):
                    self.detokenizers.add(message)
                elif isinstance(message, AbortRequests):
                    self.detokenizers.abort(message.request_ids)
                elif isinstance(message, Shutdown):
                    self.shutting_down = True
                await self.send_to_engine(message)
        except ipc.CHANNEL_BROKEN:
            pass
        done.cancel()  # the server is gone: closing B tells the engine to exit

    async def downstream(self, done: trio.CancelScope) -> None:
        """Engine core -> API server, until the engine exits."""
        try:
            while (message := await self.engine.receive()) is not None:
                if isinstance(message, StepOutputs):
                    message, stopped = self.detokenizers.process(message)
                    if stopped:
                        await self.send_to_engine(AbortRequests(stopped))
                await self.api.send(message)
        except ipc.CHANNEL_BROKEN as exc:
            logger.warning(f"a connection broke: {exc}")
        else:
            self.exit_code = 0 if self.shutting_down else 1
        done.cancel()
