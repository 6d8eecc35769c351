"""The server's HTTP routes, written once: what `trio_llm.api.app` registers, what a 404
lists, what ``trio_llm:http_requests_total`` counts by name, and which error body a path
gets (`error_style`).

Data only (this module imports nothing of the server), so the error handlers, the
middleware and the metrics can read it without importing the request models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The two error bodies: OpenAI's ``{"error": {...}}`` and Anthropic's ``{"type": "error",
#: "error": {...}}`` (`trio_llm.api.errors`).
ErrorStyle = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Route:
    """One HTTP route.

    Attributes:
        method: ``GET`` or ``POST``.
        path: the path (no path parameters).
        handler: the `trio_llm.api.serving.OpenAIServing` method answering a JSON body
            (the route is registered by `trio_llm.api.app.build_app` from this table);
            None: the route is registered with its own code.
        body: the class name of the request model the body is parsed as (with ``handler``).
        errors: the error body of this route and of every path under it (Anthropic's also
            comes with a ``request-id`` header on every response).
        listed: named in the body of a 404 (the public API; docs/api.md has them all).
        own_body_limit: the route limits its request body itself (an upload to
            ``/v1/files``: ``--max-file-size``); ``--max-request-body-bytes`` does not apply.
    """

    method: str
    path: str
    handler: str | None = None
    body: str | None = None
    errors: ErrorStyle = "openai"
    listed: bool = False
    own_body_limit: bool = False


ROUTES = (
    Route("POST", "/v1/chat/completions", "respond", "ChatCompletionRequest", listed=True),
    Route("POST", "/v1/completions", "respond", "CompletionRequest", listed=True),
    Route("POST", "/v1/responses", "respond_as", "ResponsesRequest", listed=True),
    Route("POST", "/v1/messages", "respond_as", "MessagesRequest", "anthropic", listed=True),
    Route(
        "POST",
        "/v1/messages/count_tokens",
        "count_tokens",
        "CountTokensRequest",
        "anthropic",
        listed=True,
    ),
    Route("POST", "/v1/embeddings", "embed", "EmbeddingRequest", listed=True),
    Route("GET", "/v1/models", listed=True),
    # Files and batches (issue 34); the paths under them are registered with these.
    Route("POST", "/v1/files", listed=True, own_body_limit=True),
    Route("GET", "/v1/files", listed=True),
    Route("POST", "/v1/batches", listed=True),
    Route("GET", "/v1/batches", listed=True),
    Route("POST", "/tokenize"),
    Route("POST", "/detokenize"),
    Route("GET", "/health"),
    Route("GET", "/metrics"),
)

#: ``METHOD /path`` of the routes a 404 lists, in the table's order.
LISTED_ENDPOINTS = tuple(f"{route.method} {route.path}" for route in ROUTES if route.listed)

#: The paths counted by name in ``trio_llm:http_requests_total`` (every route of the
#: table; any other path is counted as ``other``, so clients cannot grow the number of
#: series).
COUNTED_PATHS = frozenset(route.path for route in ROUTES)

#: ``(method, path)`` of the routes that limit their request body themselves.
OWN_BODY_LIMITS = frozenset((route.method, route.path) for route in ROUTES if route.own_body_limit)

#: Paths whose requests (and every path under them) get Anthropic's error body.
_ANTHROPIC_PATHS = tuple(route.path for route in ROUTES if route.errors == "anthropic")


def error_style(path: str) -> ErrorStyle:
    """The error body of a request to ``path``: Anthropic's at or under one of its routes
    (``/v1/messages``, an unknown path under it included), else OpenAI's."""
    return "anthropic" if path.startswith(_ANTHROPIC_PATHS) else "openai"
