"""The ASGI application: OpenAI-compatible routes plus /health."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from trio_llm.api import metrics
from trio_llm.api.chat_page import install_chat_page
from trio_llm.api.errors import APIError, install_error_handlers
from trio_llm.api.middleware import install_middleware
from trio_llm.api.protocol import ChatCompletionRequest, CompletionRequest
from trio_llm.api.serving import OpenAIServing
from trio_llm.api.tokenize_routes import tokenize_router
from trio_llm.api.websocket import install_websocket
from trio_llm.config import ServerConfig


def build_app(
    serving: OpenAIServing,
    is_serving: Callable[[], bool],
    config: ServerConfig | None = None,
) -> FastAPI:
    """Build the app around a ready engine.

    Args:
        serving: the completion handlers (engine, tokenizer, model names).
        is_serving: False once the server is stopping; /health then answers 503.
        config: API key, CORS and body-size settings; None uses `ServerConfig`'s defaults.
    """
    app = FastAPI(title="trio_llm", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_middleware(app, config or ServerConfig())
    app.include_router(tokenize_router(serving))
    install_websocket(app, serving, config or ServerConfig())
    engine = serving.engine
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive and is_serving():
            return Response(status_code=200)
        if not is_serving() or engine.error is None:
            reason = "the server is shutting down"
        elif engine.is_restarting:
            reason = f"the engine core is restarting after: {engine.error}"
        else:
            reason = str(engine.error)
        return APIError(503, reason, type="service_unavailable_error").response()

    registry = metrics.make_registry(engine, serving.model_names[0])

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "trio_llm",
            "root": engine.info.model_dir,
            "parent": None,
            "max_model_len": engine.info.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [model_card(name) for name in serving.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        return JSONResponse(model_card(serving.resolve_model(model)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request.receive)

    install_chat_page(app)
    return app
