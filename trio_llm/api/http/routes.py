"""The server's HTTP routes, written once: what `trio_llm.api.app` registers, what a 404
lists, what ``trio_llm:http_requests_total`` counts by name, and which error body a path
gets (`error_style`).

Data only (this module imports nothing of the server), so the error handlers, the
middleware and the metrics can read it without importing the request models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

#: The two error bodies: OpenAI's ``{"error": {...}}`` and Anthropic's ``{"type": "error",
#: "error": {...}}`` (`trio_llm.api.http.errors`).
ErrorStyle = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Route:
    """One HTTP route.

    Attributes:
        method: ``GET``, ``POST`` or ``DELETE``.
        path: the path; ``{name}`` is a path parameter (one segment).
        handler: what answers the route, registered by `trio_llm.api.app.build_app` from
            this table: a method of the model's `trio_llm.api.chat.serving.ModelServing`,
            or ``owner.method`` of an API's own handlers (the owners `build_app` names:
            ``responses``, ``conversations``, ``anthropic``, ``embeddings``,
            ``scoring``). A route with a ``body`` and no path parameter is parsed first
            and its handler given the request model and ``receive`` (and, when
            ``routed``, the model's serving); any other handler is given the request.
            None: the route is registered with its own code.
        body: the key of the request model the body is parsed as (`build_app`'s table of
            body models; with ``handler``; a route with path parameters parses it
            itself: the key documents it).
        routed: the body's ``model`` chooses the model that answers
            (`trio_llm.api.model_router`): the handler runs with a lease on it.
        errors: the error body of this route and of every path under it (Anthropic's also
            comes with a ``request-id`` header on every response).
        listed: named in the body of a 404 (the public API; docs/api.md has them all;
            vLLM's utility routes, /health and /metrics are not).
        own_body_limit: the route limits its request body itself (an upload to
            ``/v1/files``: ``--max-file-size``); ``--max-request-body-bytes`` does not apply.
    """

    method: str
    path: str
    handler: str | None = None
    body: str | None = None
    errors: ErrorStyle = "openai"
    routed: bool = False
    listed: bool = True
    own_body_limit: bool = False


def _routed(
    method: str, path: str, handler: str, body: str, errors: ErrorStyle = "openai"
) -> Route:
    """A route whose body's ``model`` chooses the model that answers it."""
    return Route(method, path, handler, body, errors, routed=True)


#: Paths of one stored response and one conversation (the table's rows fit a line each).
_RESPONSE = "/v1/responses/{response_id}"
_CONVERSATION = "/v1/conversations/{conversation_id}"
_COUNT_TOKENS = "/v1/messages/count_tokens"

ROUTES = (
    _routed("POST", "/v1/chat/completions", "respond", "chat"),
    _routed("POST", "/v1/completions", "respond", "completion"),
    _routed("POST", "/v1/responses", "responses.create", "responses"),
    Route("GET", _RESPONSE, "responses.retrieve"),
    Route("DELETE", _RESPONSE, "responses.delete"),
    Route("GET", f"{_RESPONSE}/input_items", "responses.input_items"),
    Route("POST", f"{_RESPONSE}/cancel", "responses.cancel"),
    Route("POST", "/v1/conversations", "conversations.create", "conversation"),
    Route("GET", _CONVERSATION, "conversations.retrieve"),
    Route("POST", _CONVERSATION, "conversations.update", "conversation_update"),
    Route("DELETE", _CONVERSATION, "conversations.delete"),
    Route("GET", f"{_CONVERSATION}/items", "conversations.list_items"),
    Route("POST", f"{_CONVERSATION}/items", "conversations.add_items", "conversation_items"),
    Route("GET", f"{_CONVERSATION}/items/{{item_id}}", "conversations.get_item"),
    Route("DELETE", f"{_CONVERSATION}/items/{{item_id}}", "conversations.delete_item"),
    _routed("POST", "/v1/messages", "anthropic.create", "messages", "anthropic"),
    _routed("POST", _COUNT_TOKENS, "anthropic.count_tokens", "count_tokens", "anthropic"),
    _routed("POST", "/v1/embeddings", "embeddings.create", "embeddings"),
    # Score and rerank (issue 45): vLLM's paths, with and without a version.
    _routed("POST", "/score", "scoring.score", "score"),
    _routed("POST", "/v1/score", "scoring.score", "score"),
    _routed("POST", "/rerank", "scoring.rerank", "rerank"),
    _routed("POST", "/v1/rerank", "scoring.rerank", "rerank"),
    _routed("POST", "/v2/rerank", "scoring.rerank", "rerank"),
    Route("GET", "/v1/models"),
    # Files and batches (issue 34); the paths under them are registered with these.
    Route("POST", "/v1/files", own_body_limit=True),
    Route("GET", "/v1/files"),
    Route("POST", "/v1/batches"),
    Route("GET", "/v1/batches"),
    Route("POST", "/tokenize", listed=False),
    Route("POST", "/detokenize", listed=False),
    Route("GET", "/health", listed=False),
    Route("GET", "/metrics", listed=False),
    # A server of several models (issue 35): llama.cpp's router routes.
    Route("POST", "/models/load", listed=False),
    Route("POST", "/models/unload", listed=False),
    Route("POST", "/models/reload", listed=False),
)

#: ``METHOD /path`` of the routes a 404 lists, in the table's order.
LISTED_ENDPOINTS = tuple(f"{route.method} {route.path}" for route in ROUTES if route.listed)

#: The paths counted by name in ``trio_llm:http_requests_total`` (every route of the
#: table, a path with parameters by its template; any other path is counted as
#: ``other``, so clients cannot grow the number of series).
COUNTED_PATHS = frozenset(route.path for route in ROUTES)

#: The routes' paths with parameters, as patterns (``{name}``: one segment).
_TEMPLATES = tuple(
    (
        re.compile(
            "/".join(
                "[^/]+" if part.startswith("{") else re.escape(part) for part in path.split("/")
            )
            + "$"
        ),
        path,
    )
    for path in sorted(COUNTED_PATHS)
    if "{" in path
)


def route_path(path: str) -> str | None:
    """The table's path ``path`` is (a template for a path with parameters:
    ``/v1/responses/resp_1`` is ``/v1/responses/{response_id}``), or None."""
    if path in COUNTED_PATHS:
        return path
    for pattern, template in _TEMPLATES:
        if pattern.match(path):
            return template
    return None


#: ``(method, path)`` of the routes that limit their request body themselves.
OWN_BODY_LIMITS = frozenset((route.method, route.path) for route in ROUTES if route.own_body_limit)

#: Paths whose requests (and every path under them) get Anthropic's error body.
_ANTHROPIC_PATHS = tuple(route.path for route in ROUTES if route.errors == "anthropic")


def error_style(path: str) -> ErrorStyle:
    """The error body of a request to ``path``: Anthropic's at or under one of its routes
    (``/v1/messages``, an unknown path under it included), else OpenAI's."""
    return "anthropic" if path.startswith(_ANTHROPIC_PATHS) else "openai"
