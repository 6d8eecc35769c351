"""The ASGI application: the routes of `trio_llm.api.http.routes` (OpenAI's, Anthropic's and
vLLM's), the models' routes (`trio_llm.api.model_cards`: ``/v1/models``, ``/health``,
``/models/load``...), ``/metrics``, the WebSocket and the chat page, over the models of a
`trio_llm.api.model_router.ModelRouter`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive

from trio_llm.api import metrics
from trio_llm.api.anthropic.handlers import MessagesAPI
from trio_llm.api.anthropic.request import CountTokensRequest, MessagesRequest
from trio_llm.api.batch.files import install_file_routes
from trio_llm.api.batch.routes import install_batch_routes
from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.request_body import RequestBody
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.chat_page import install_chat_page
from trio_llm.api.embeddings import EmbeddingRequest, EmbeddingsAPI
from trio_llm.api.http.access_log import AccessLogMiddleware
from trio_llm.api.http.body_reading import read_body
from trio_llm.api.http.errors import bad_request, install_error_handlers
from trio_llm.api.http.lanes import DATA_PARALLEL_RANK_HEADER, data_parallel_rank_of, lane_of
from trio_llm.api.http.middleware import install_middleware
from trio_llm.api.http.routes import ROUTES
from trio_llm.api.model_cards import install_model_routes
from trio_llm.api.model_router import LeaseReleaser, ModelRouter, as_router, hold, peek_model
from trio_llm.api.responses.conversations import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationsAPI,
    ConversationUpdateRequest,
)
from trio_llm.api.responses.handlers import ResponsesAPI
from trio_llm.api.responses.request import ResponsesRequest
from trio_llm.api.scoring import RerankRequest, ScoreRequest, ScoringAPI
from trio_llm.api.tokenize_routes import tokenize_router
from trio_llm.api.websocket.handler import install_websocket
from trio_llm.server_config import ServerConfig

#: The request models of the JSON body routes, by their key in the table (`Route.body`).
_BODY_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
    "count_tokens": CountTokensRequest,
    "embeddings": EmbeddingRequest,
    "score": ScoreRequest,
    "rerank": RerankRequest,
    "conversation": ConversationCreateRequest,
    "conversation_update": ConversationUpdateRequest,
    "conversation_items": ConversationItemsRequest,
}


def build_app(
    serving: ModelServing | ModelRouter,
    is_serving: Callable[[], bool],
    config: ServerConfig | None = None,
    responses: ResponsesAPI | None = None,
) -> FastAPI:
    """Build the app around ready models.

    Args:
        serving: the models' router (`trio_llm.api.model_router`; the server's is
            `trio_llm.server.model_pool.ModelPool`), or the handlers of one model
            (`ModelServing`: engine, tokenizer, model names).
        is_serving: False once the server is stopping; /health then answers 503.
        config: API key, CORS and body-size settings; None uses `ServerConfig`'s defaults.
        responses: the Responses API (the supervisor makes it, to run its background
            responses); None: a new one (background responses are then refused with a
            503: nothing runs them).
    """
    router = as_router(serving)
    config = config or ServerConfig()
    app = FastAPI(title="trio_llm", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_middleware(app, config)
    app.add_middleware(LeaseReleaser)
    app.include_router(tokenize_router(router))
    install_websocket(app, router, config)
    install_model_routes(app, router, is_serving, config.allow_runtime_lora_updating)
    _add_metrics(app, router, config)
    owners = {
        "responses": responses or ResponsesAPI(router),
        "conversations": ConversationsAPI(router),
        "anthropic": MessagesAPI(),
        "embeddings": EmbeddingsAPI(),
        "scoring": ScoringAPI(),
    }
    _add_table_routes(app, router, owners)
    # Files and batches (issue 34): the routes, and the batch runner the supervisor starts.
    install_file_routes(app, router, config)
    install_batch_routes(app, router, config)
    install_chat_page(app)
    if not config.disable_access_log:
        app.add_middleware(AccessLogMiddleware)  # outermost: every answer is logged
    return app


def _add_metrics(app: FastAPI, router: ModelRouter, config: ServerConfig) -> None:
    """``GET /metrics``, and the middleware counting HTTP requests (the outermost so far)."""
    registry = metrics.make_registry(router)
    app.add_middleware(metrics.HTTPRequestCounter, registry=registry, model_name=router.names()[0])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = metrics.render(registry, vllm_names=config.vllm_metric_names)
        return Response(text, media_type=metrics.CONTENT_TYPE)


def _add_table_routes(app: FastAPI, router: ModelRouter, owners: dict[str, Any]) -> None:
    """The routes of `trio_llm.api.http.routes.ROUTES` that have a handler: a method of the
    request's model's `ModelServing`, or ``owner.method`` of one of ``owners``.

    A body route without path parameters is parsed before its handler runs (limits
    first, large ones off the event loop), not by FastAPI; the OpenAPI document still
    describes every body. A routed one (`Route.routed`) is parsed by the model its body
    names, with a lease on it until the response is over.
    """
    body_models = []
    for route in ROUTES:
        if route.handler is None:
            continue
        owner_name, _, method = route.handler.rpartition(".")
        body_model = _BODY_MODELS[route.body] if route.body is not None else None
        if body_model is not None:
            body_models.append(body_model)
        if route.routed:
            if body_model is None:
                raise RuntimeError(f"the routed route {route.path} names no body model")
            owner = owners[owner_name] if owner_name else None
            handler = _routed_endpoint(router, body_model, owner, method)
        else:
            handler = getattr(owners[owner_name], method)
            if body_model is not None and "{" not in route.path:
                handler = _endpoint(router, body_model, handler)
        app.add_api_route(
            route.path,
            handler,
            methods=[route.method],
            openapi_extra=None if body_model is None else _json_body(body_model),
            name=route.path.removeprefix("/v1/").replace("/", "_"),
        )
    _document_bodies(app, tuple(body_models))


def _bind(body: BaseModel, request: Request, num_engines: int | None = None) -> None:
    """Give a parsed body its lane (the ASGI scope's: `trio_llm.api.http.lanes`, the batch
    runner's requests run in the batch lane), the engine rank its headers name when
    ``num_engines`` engines serve its model, and a response its client's address.

    Raises:
        APIError: 400 naming the ``X-data-parallel-rank`` header: not a rank it can have.
    """
    if isinstance(body, RequestBody):
        body.bind_lane(lane_of(request.scope))
        if num_engines is not None:
            try:
                rank = data_parallel_rank_of(request.headers, num_engines)
            except ValueError as exc:
                raise bad_request(str(exc), DATA_PARALLEL_RANK_HEADER) from None
            body.bind_data_parallel_rank(rank)
    if isinstance(body, ResponsesRequest):
        body.bind_connection(tuple(request.client) if request.client else None)


def _routed_endpoint(
    router: ModelRouter, body_model: type[BaseModel], owner: Any, method: str
) -> Callable[[Request], Awaitable[Response]]:
    """A route whose body's ``model`` chooses the model: a lease on it (held until the
    response is over, `trio_llm.api.model_router.LeaseReleaser`), the body parsed by it,
    then its ``method`` (or ``owner.method(body, receive, serving)``) answers."""

    async def endpoint(request: Request) -> Response:
        raw = await read_body(request, router.request_body_timeout)
        name, keep_alive = await peek_model(raw)
        lease = await router.acquire_for(request.scope, name, keep_alive)
        hold(request.scope, lease)
        serving = lease.serving
        body = await serving.parse(body_model, request)
        _bind(body, request, len(serving.engine.engines))
        if owner is None:
            return await getattr(serving, method)(body, request.receive)
        return await getattr(owner, method)(body, request.receive, serving)

    return endpoint


def _endpoint(
    router: ModelRouter,
    body_model: type[BaseModel],
    handler: Callable[[Any, Receive], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A route that parses its body as ``body_model`` (no model's limits apply) and
    answers with ``handler``."""

    async def endpoint(request: Request) -> Response:
        body = await router.parse(body_model, request)
        _bind(body, request)
        return await handler(body, request.receive)

    return endpoint


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI ``requestBody`` naming ``model``'s schema (see `_document_bodies`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add ``models``' JSON schemas to the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
