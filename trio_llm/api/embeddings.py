"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, served by an embedding model.

The request runs the same admission, engine client and disconnect handling as the
generating routes (`trio_llm.api.chat.serving.ModelServing.embed`, with the pieces here:
`embedding_plan`, `collect_embeddings`, `embeddings_body`); the engine child is a
`trio_llm.engine.pooling.PoolingCore`, which batches the inputs of all clients together.

Supported: ``input`` as a string, a list of strings, a list of token ids or a list of
lists of token ids; ``encoding_format`` ``float`` or ``base64`` (little-endian float32,
as OpenAI sends it); ``dimensions`` for models trained to be truncated (Matryoshka: the
model's ``config.json`` lists ``matryoshka_dimensions``), refused for others; ``user``.
An input longer than the model's context is refused (400), never truncated silently.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import trio
from fastapi.responses import Response
from pydantic import Field, StrictInt
from starlette.types import Receive

from trio_llm.api.chat.format import ChatFormat
from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.request_body import INT32_MAX, Priority, RequestBody, Text, TokenId
from trio_llm.api.chat.run_choices import run_connected
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.http.body_reading import CLIENT_CLOSED_REQUEST
from trio_llm.api.http.errors import bad_request, invalid_request
from trio_llm.errors import ContextLengthError, InvalidRequest
from trio_llm.frontend.admission import Admission
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.messages import EngineReady, SamplingParams, Scheduling

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048

#: An embeddings request with more inputs than this is tokenized and rendered in a
#: worker thread (both grow with the request).
INLINE_EMBEDDING_INPUTS = 8


class EmbeddingRequest(RequestBody):
    """``POST /v1/embeddings`` (OpenAI's field names)."""

    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    user: Text | None = None
    priority: Priority = 0

    def inputs(self) -> list[str | list[int]]:
        """Each input (a text, or token ids) in order.

        Raises:
            APIError: no input, an empty one, or more than `MAX_INPUTS` (400, ``input``).
        """
        value = self.input
        if isinstance(value, str):
            items: list[str | list[int]] = [value]
        elif value and isinstance(value[0], int):
            items = [value]  # type: ignore[list-item]
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise bad_request("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise bad_request(
                f"{len(items)} inputs is more than the limit of {MAX_INPUTS} per request", "input"
            )
        if any(len(item) == 0 for item in items):
            raise bad_request("input must not contain an empty string or token list", "input")
        return items


def check_dimensions(dimensions: int | None, embedding_dim: int, allowed: list[int]) -> None:
    """Refuse a ``dimensions`` the model cannot give.

    Args:
        dimensions: the requested length, or None.
        embedding_dim: the model's vector length.
        allowed: lengths the model was trained to be truncated to (Matryoshka), or empty.

    Raises:
        APIError: 400 naming ``dimensions``.
    """
    if dimensions is None or dimensions == embedding_dim:
        return
    if not allowed:
        raise bad_request(
            f"this model does not support dimensions (its vectors have {embedding_dim}; it "
            "was not trained for shorter ones)",
            "dimensions",
        )
    if dimensions not in allowed:
        raise bad_request(f"dimensions must be one of {sorted(allowed)}", "dimensions")


@functools.cache
def matryoshka_dimensions(model_dir: str) -> list[int]:
    """The vector lengths a model was trained to be cut to (``matryoshka_dimensions`` in
    its ``config.json``), or an empty list; read once per folder."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    dims = config.get("matryoshka_dimensions")
    return [d for d in dims if isinstance(d, int)] if isinstance(dims, list) else []


def shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """A Matryoshka vector cut to ``dimensions`` values; a unit-length vector (a model
    that normalizes) is normalized again after the cut."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    normalized = abs(math.sqrt(sum(v * v for v in vector)) - 1.0) < 1e-3
    vector = vector[:dimensions]
    if normalized:
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    return vector


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """The ``embedding`` field: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def response(
    model: str, vectors: list[list[float] | str], num_prompt_tokens: int
) -> dict[str, Any]:
    """The response body (OpenAI's ``list`` of ``embedding`` objects, with usage)."""
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


async def embedding_plan(
    request: EmbeddingRequest, model: str, inputs: InputPreprocessor, info: EngineReady
) -> Plan:
    """Check ``request`` against the model (``info``) and tokenize its inputs: a `Plan`
    with one engine request per input, in order (`pooling_plan`).

    Raises:
        APIError: 400 for a ``dimensions`` the model cannot give, a nonzero ``priority``
            the engine does not serve, an empty, refused or too long input
            (`embedding_prompts`).
    """
    check_dimensions(request.dimensions, info.embedding_dim, matryoshka_dimensions(info.model_dir))
    scheduling = request.scheduling(request.priority, info.scheduling_policy)
    prompts = await embedding_prompts(inputs, request.inputs())
    return pooling_plan(prompts, scheduling, model, inputs)


def pooling_plan(
    prompts: list[list[int]],
    scheduling: Scheduling,
    model: str,
    inputs: InputPreprocessor,
    params: Sequence[SamplingParams] | None = None,
) -> Plan:
    """A `Plan` of one pooling (embedding or score) engine request per prompt, in order,
    with ``params[i]`` (default: ``max_tokens=0`` for all); its format only serves
    admission's bookkeeping."""
    plan = Plan(ChatFormat(inputs.tokenizer), model, scheduling=scheduling)
    default = SamplingParams(max_tokens=0)
    for i, ids in enumerate(prompts):
        plan.add_prompt(ids, [params[i] if params is not None else default], None)
    return plan


async def embedding_prompts(
    inputs: InputPreprocessor, items: Sequence[str | list[int]], param: str = "input"
) -> list[list[int]]:
    """The token ids of every input (`EmbeddingRequest.inputs`), texts with the
    tokenizer's special tokens; in a worker thread unless there is little of it.
    ``param`` is the request field they came from (named by a 400).

    Raises:
        APIError: 400 for an input the preprocessor refuses (a token id outside the
            vocabulary, a text with no tokens) or longer than the context (never cut).
    """
    max_model_len = inputs.max_model_len

    def tokenize() -> list[list[int]]:
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = inputs.encode(item, param, special_tokens=True)
            else:
                ids = inputs.check_token_ids(item, param)
            if len(ids) > max_model_len:
                raise ContextLengthError(max_model_len, len(ids), param, prompt_name=param)
            prompts.append(ids)
        return prompts

    try:
        # Up to 2,048 inputs: their tokenizing grows with the request, so it runs in
        # a worker thread unless there is little of it.
        if len(items) <= INLINE_EMBEDDING_INPUTS and sum(map(len, items)) < 4096:
            return tokenize()
        return await trio.to_thread.run_sync(tokenize)
    except InvalidRequest as exc:
        raise invalid_request(exc) from exc


async def collect_embeddings(
    engine: EngineHandle, plan: Plan, admission: Admission, vectors: list[list[float]]
) -> None:
    """Submit the admitted requests of ``plan`` together and store each one's vector in
    ``vectors`` (its place in input order).

    Raises:
        EngineError: the engine failed the requests.
    """
    async with engine.open_requests(plan.requests, admission, plan.scheduling) as streams:
        for i, stream in enumerate(streams):
            async for delta in stream:
                if delta.embedding is not None:
                    vectors[i] = delta.embedding


async def embeddings_body(
    model: str, vectors: list[list[float]], request: EmbeddingRequest, num_prompt_tokens: int
) -> bytes:
    """The JSON response body (`response`) of ``vectors``, each cut to the request's
    ``dimensions`` and in its ``encoding_format``; rendered in a worker thread for a
    large batch (hundreds of thousands of floats)."""

    def render() -> bytes:
        data = [
            encode(shorten(vector, request.dimensions), request.encoding_format)
            for vector in vectors
        ]
        # msgspec, not json.dumps: either holds the GIL for the whole body, so the
        # worker thread stalls the event loop while it runs; 2,048 vectors of 384
        # floats take json.dumps about a second and msgspec a twentieth of that.
        return msgspec.json.encode(response(model, data, num_prompt_tokens))

    if len(vectors) <= INLINE_EMBEDDING_INPUTS:
        return render()
    return await trio.to_thread.run_sync(render)


class EmbeddingsAPI:
    """``POST /v1/embeddings`` (the route table's owner ``embeddings``)."""

    async def create(
        self, request: EmbeddingRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Tokenize every input, submit them together (the engine batches them with other
        clients'), and answer their vectors in input order.

        Raises:
            APIError: 400 for a generating model, an empty or too long input, or a
                ``dimensions`` the model cannot give; 503 when the waiting line is full.
        """
        model = serving.resolve_model(request.model)
        serving.check_task("embed", "/v1/embeddings", model)
        plan = await embedding_plan(request, model, serving.inputs, serving.engine.info)
        admission = serving.admit(plan)
        vectors: list[list[float]] = [[] for _ in plan.requests]
        collect = functools.partial(collect_embeddings, serving.engine, plan, admission, vectors)
        if not await run_connected(serving.engine, receive, admission, collect):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = await embeddings_body(model, vectors, request, sum(plan.prompt_lengths))
        return Response(body, media_type="application/json")
