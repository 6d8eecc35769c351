"""The ASGI application: the routes of `trio_llm.api.routes` (OpenAI's, Anthropic's and
vLLM's), ``/health``, ``/metrics``, the WebSocket and the chat page."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Receive

from trio_llm.api import metrics
from trio_llm.api.anthropic import CountTokensRequest, MessagesRequest
from trio_llm.api.batches import install_batch_routes
from trio_llm.api.chat_page import install_chat_page
from trio_llm.api.chat_request import ChatCompletionRequest
from trio_llm.api.completion_request import CompletionRequest
from trio_llm.api.conversations import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationsAPI,
    ConversationUpdateRequest,
)
from trio_llm.api.embeddings import EmbeddingRequest
from trio_llm.api.errors import APIError, install_error_handlers
from trio_llm.api.files import install_file_routes
from trio_llm.api.lanes import lane_of
from trio_llm.api.middleware import install_middleware
from trio_llm.api.request_body import RequestBody
from trio_llm.api.responses import ResponsesRequest
from trio_llm.api.routes import ROUTES
from trio_llm.api.serving import OpenAIServing
from trio_llm.api.stored_responses import ResponsesAPI
from trio_llm.api.tokenize_routes import tokenize_router
from trio_llm.api.websocket import install_websocket
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.handle import EngineHandle
from trio_llm.server_config import ServerConfig

#: The request models of the JSON body routes, by class name (`Route.body`).
_BODY_MODELS: dict[str, type[BaseModel]] = {
    model.__name__: model
    for model in (
        ChatCompletionRequest,
        CompletionRequest,
        ResponsesRequest,
        MessagesRequest,
        CountTokensRequest,
        EmbeddingRequest,
        ConversationCreateRequest,
        ConversationUpdateRequest,
        ConversationItemsRequest,
    )
}


def build_app(
    serving: OpenAIServing,
    is_serving: Callable[[], bool],
    config: ServerConfig | None = None,
    responses: ResponsesAPI | None = None,
) -> FastAPI:
    """Build the app around a ready engine.

    Args:
        serving: the completion handlers (engine, tokenizer, model names).
        is_serving: False once the server is stopping; /health then answers 503.
        config: API key, CORS and body-size settings; None uses `ServerConfig`'s defaults.
        responses: the Responses API over ``serving`` (the supervisor makes it, to run
            its background responses); None: a new one (background responses are then
            refused with a 503: nothing runs them).
    """
    config = config or ServerConfig()
    app = FastAPI(title="trio_llm", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_middleware(app, config)
    app.include_router(tokenize_router(serving))
    install_websocket(app, serving, config)
    _add_health(app, serving.engine, is_serving)
    _add_metrics(app, serving, config)
    _add_models(app, serving)
    owners = {
        "responses": responses or ResponsesAPI(serving),
        "conversations": ConversationsAPI(serving),
    }
    _add_table_routes(app, serving, owners)
    # Files and batches (issue 34): the routes, and the batch runner the supervisor starts.
    install_file_routes(app, serving, config)
    install_batch_routes(app, serving, config)
    install_chat_page(app)
    return app


def _add_health(app: FastAPI, engine: EngineHandle, is_serving: Callable[[], bool]) -> None:
    """``GET /health``: 200 while serving (a body when some engines do not), else 503."""

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive and is_serving():
            engines = engine.engines
            serving = sum(client.is_alive for client in engines)
            if serving == len(engines):
                return Response(status_code=200)
            return JSONResponse(_degraded(engines, serving), status_code=200)
        if not is_serving() or engine.error is None:
            reason = "the server is shutting down"
        elif engine.is_restarting:
            reason = f"the engine core is restarting after: {engine.error}"
        else:
            reason = str(engine.error)
        return APIError(503, reason, type="service_unavailable_error").response()


def _add_metrics(app: FastAPI, serving: OpenAIServing, config: ServerConfig) -> None:
    """``GET /metrics``, and the middleware counting HTTP requests (the outermost so far)."""
    registry = metrics.make_registry(serving.engine, serving.model_names[0])
    app.add_middleware(
        metrics.HTTPRequestCounter, registry=registry, model_name=serving.model_names[0]
    )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        text = metrics.render(registry, vllm_names=config.vllm_metric_names)
        return Response(text, media_type=metrics.CONTENT_TYPE)


def _add_models(app: FastAPI, serving: OpenAIServing) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{model}``: vLLM's model cards."""
    engine = serving.engine
    created = int(time.time())

    def model_card(name: str) -> dict:
        # vLLM's model card, field for field (clients that list models read these).
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "trio_llm",
            "root": engine.info.model_dir,
            "parent": None,
            "max_model_len": engine.info.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": engine.info.task == "generate",
                    "allow_logprobs": engine.info.task == "generate",
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [model_card(name) for name in serving.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        return JSONResponse(model_card(serving.resolve_model(model)))


def _add_table_routes(app: FastAPI, serving: OpenAIServing, owners: dict[str, Any]) -> None:
    """The routes of `trio_llm.api.routes.ROUTES` that have a handler: a method of
    ``serving``, or ``owner.method`` of one of ``owners``.

    A body route without path parameters is parsed by `serving.parse` (limits first,
    large ones off the event loop), not by FastAPI; the OpenAPI document still describes
    every body.
    """
    body_models = []
    for route in ROUTES:
        if route.handler is None:
            continue
        owner_name, _, method = route.handler.rpartition(".")
        handler = getattr(owners[owner_name] if owner_name else serving, method)
        body_model = _BODY_MODELS[route.body] if route.body is not None else None
        if body_model is not None:
            body_models.append(body_model)
        if body_model is not None and "{" not in route.path:
            handler = _endpoint(serving, body_model, handler)
        app.add_api_route(
            route.path,
            handler,
            methods=[route.method],
            openapi_extra=None if body_model is None else _json_body(body_model),
            name=route.path.removeprefix("/v1/").replace("/", "_"),
        )
    _document_bodies(app, tuple(body_models))


def _degraded(engines: list[EngineClient], serving: int) -> dict[str, Any]:
    """The /health body while some data-parallel engines do not serve: the count, and
    each engine's state (``serving``, ``restarting`` or ``failed``) with its last error."""
    states = []
    for rank, client in enumerate(engines):
        state = "serving" if client.is_alive else "restarting" if client.is_restarting else "failed"
        entry: dict[str, Any] = {"engine": rank, "state": state}
        if client.error is not None and not client.is_alive:
            entry["error"] = str(client.error)
        states.append(entry)
    return {
        "status": "degraded",
        "engines_serving": serving,
        "data_parallel_size": len(engines),
        "engines": states,
    }


def _endpoint(
    serving: OpenAIServing,
    body_model: type[BaseModel],
    handler: Callable[[Any, Receive], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A route that parses its body as ``body_model`` and answers with ``handler``; the
    body's lane is the ASGI scope's (`trio_llm.api.lanes`: the batch runner's requests
    run in the batch lane)."""

    async def endpoint(request: Request) -> Response:
        lane = lane_of(request.scope)
        body = await serving.parse(body_model, request)
        if isinstance(body, RequestBody):
            body.bind_lane(lane)
        if isinstance(body, ResponsesRequest):
            body.bind_connection(tuple(request.client) if request.client else None)
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
