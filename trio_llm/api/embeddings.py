"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, served by an embedding model.

The request runs the same admission, engine client and disconnect handling as the
generating routes (`trio_llm.api.serving.OpenAIServing.embed`); the engine child is a
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
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, StrictInt

from trio_llm.api.errors import bad_request
from trio_llm.api.request_body import INT32_MAX, RequestBody, Text, TokenId

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    """``POST /v1/embeddings`` (OpenAI's field names)."""

    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    user: Text | None = None

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
