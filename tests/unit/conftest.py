"""Shared by the unit tests: tokenizer fixtures for the detokenizer tests (byte-level and
SentencePiece-style), and the engine core played by a test over an in-memory stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from trio_llm import ipc
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.messages import (
    AbortRequests,
    AddRequest,
    EngineReady,
    HealthCheck,
    HealthReply,
    RequestOutput,
    StepOutputs,
    StepStats,
)

SONNETS = Path(__file__).parents[2] / "bench" / "data" / "sonnet.txt"

#: The special tokens of a Llama-2-style vocabulary (the byte tokens are not special).
SENTENCEPIECE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def build_sentencepiece_style_tokenizer(vocab_size: int = 800) -> Tokenizer:
    """A Llama-2-style tokenizer: BPE over '▁'-joined text with byte fallback.

    Trained on the sonnets in ``bench/data``. The 256 ``<0xNN>`` byte tokens are ordinary
    vocabulary entries, as in Llama 2's ``tokenizer.json``: if they were special tokens,
    ``decode(..., skip_special_tokens=True)`` would silently drop every character that
    needed byte fallback (emoji, CJK) and the byte-fallback path would go untested.
    """
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SENTENCEPIECE_SPECIAL_TOKENS, *byte_tokens]
    )
    tokenizer.train_from_iterator(SONNETS.read_text().splitlines(), trainer)
    # The trainer registers all its special tokens as added (special) tokens; keep the
    # byte tokens in the model's vocabulary only.
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [
        token for token in data["added_tokens"] if token["content"] in SENTENCEPIECE_SPECIAL_TOKENS
    ]
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="session")
def byte_level(smol_tokenizer) -> Tokenizer:
    """SmolLM2's byte-level BPE (the ``tokenizers`` backend)."""
    return smol_tokenizer.backend


@pytest.fixture(scope="session")
def sentencepiece_style() -> Tokenizer:
    """See :func:`build_sentencepiece_style_tokenizer`."""
    return build_sentencepiece_style_tokenizer()


def stop_reference(
    text: str, stop: list[str], *, include_stop_str_in_output: bool = False
) -> tuple[str, str | None]:
    """Stop strings applied to a whole text by brute force: ``(output, matched stop)``.

    Scans every end index from the left; the first one at which the text ends with a
    stop string decides. If several stop strings end there, the longest wins.
    """
    stops = [s for s in stop if s]
    for end in range(len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            hit = max(hits, key=len)
            cut = end if include_stop_str_in_output else end - len(hit)
            return text[:cut], hit
    return text, None


#: What a fake engine core reports when it starts, and the stats of each of its steps.
INFO = EngineReady("/model", 256, 64, 16, [2], 49152, "float32", 1)
STATS = StepStats(1, 0, 1, 1, 0, 60, 0, 0.01)


def engine_client_pair(
    info: EngineReady = INFO,
    *,
    step_timeout: float | None = None,
    restart_wait: float | None = None,
) -> tuple[EngineClient, trio.abc.Stream]:
    """The server's `EngineClient` and, for a fake engine, the other end of its stream."""
    left, right = trio.testing.memory_stream_pair()
    client = EngineClient(
        ipc.server_channel(left), info, step_timeout=step_timeout, restart_wait=restart_wait
    )
    return client, right


class FakeEngine:
    """The engine core, played by the test over an in-memory stream: keeps every message
    the server sends (``received``; the ids of ``added`` and ``aborted`` requests) and
    sends outputs only when the test says so. `on_message` is a subclass's script.

    It answers each `HealthCheck` at once, as a working engine's loop does (those are not
    kept in ``received``), while ``answers_health_checks`` is True.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.channel = ipc.engine_channel(stream)
        self.server_side = ipc.MessageChannel(self.channel.framed, object)
        self.received: list[object] = []
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.arrived = trio.Event()
        self.answers_health_checks = True
        #: Health checks received (answered or not), and those left unanswered.
        self.num_health_checks = 0
        self.unanswered: list[HealthCheck] = []

    async def run(self) -> None:
        while (message := await self.channel.receive()) is not None:
            if isinstance(message, HealthCheck):
                self.num_health_checks += 1
                if self.answers_health_checks:
                    await self.server_side.send(HealthReply(message.seq))
                else:
                    self.unanswered.append(message)
                continue
            self.received.append(message)
            if isinstance(message, AddRequest):
                self.added.append(message.request_id)
            elif isinstance(message, AbortRequests):
                self.aborted += message.request_ids
            await self.on_message(message)
            self.arrived.set()
            self.arrived = trio.Event()

    async def on_message(self, message: object) -> None:
        """Called with each message from the server, after it is recorded."""

    async def wait_for_requests(self, count: int) -> None:
        while len(self.added) < count:
            await self.arrived.wait()

    async def wait_for(self, kind: type) -> object:
        """The first received message of type ``kind`` (taken out of ``received``)."""
        while True:
            for message in self.received:
                if isinstance(message, kind):
                    self.received.remove(message)
                    return message
            await self.arrived.wait()

    async def output(self, request_id: str, finish: str | None = None) -> None:
        await self.server_side.send(StepOutputs([RequestOutput(request_id, [28], finish)], STATS))

    async def tokens(self, request_id: str, count: int) -> None:
        """``count`` steps of one token each for ``request_id``."""
        outputs = [RequestOutput(request_id, [28])]
        for _ in range(count):
            await self.server_side.send(StepOutputs(outputs, STATS))


class ScriptedEngine(FakeEngine):
    """Answers every request with the given tokens, one per step, then the end token 2
    (finish "stop")."""

    def __init__(self, stream: trio.abc.Stream, token_ids: list[int]) -> None:
        super().__init__(stream)
        self.token_ids = token_ids

    async def on_message(self, message: object) -> None:
        if isinstance(message, AddRequest):
            for token in self.token_ids:
                output = RequestOutput(message.request_id, [token])
                await self.server_side.send(StepOutputs([output], STATS))
            done = RequestOutput(message.request_id, [2], "stop")
            await self.server_side.send(StepOutputs([done], STATS))


@asynccontextmanager
async def app_client(
    tokenizer: Any,
    fake_engine: Callable[[trio.abc.Stream], FakeEngine],
    *,
    raise_app_exceptions: bool = True,
    **serving: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    """An HTTP client of the real app (model ``m``, ``serving``: `ModelServing`'s
    keywords) over an engine played by ``fake_engine(stream)``, which is yielded too."""
    from trio_llm.api.app import build_app
    from trio_llm.api.chat.serving import ModelServing

    async with trio.open_nursery() as nursery:
        engine, stream = engine_client_pair()
        fake = fake_engine(stream)
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        app = build_app(ModelServing(engine, tokenizer, ("m",), **serving), lambda: True)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, fake
        nursery.cancel_scope.cancel()
