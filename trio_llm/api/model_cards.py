"""The routes about the served models: ``GET /v1/models`` (vLLM's model cards, each with
its ``status``), ``GET /v1/models/{model}``, ``/health``, and llama.cpp's router routes
``POST /models/load``, ``POST /models/unload`` and ``POST /models/reload``.

With ``--enable-lora`` the cards list each LoRA adapter with its base model as
``parent``; with ``--allow-runtime-lora-updating`` vLLM's ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` change which adapters are served
(`trio_llm.frontend.lora_adapters`).

``/health`` of a server of one model is what it always was: an empty 200 while it
serves, a body only while some data-parallel engines do not, 503 once stopping. A
server of several models answers 200 while it serves, with each model's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from trio_llm.api.chat.request_body import RequestBody, Text
from trio_llm.api.http.errors import APIError, unknown_model, without_host_paths
from trio_llm.api.model_router import ModelRouter, ModelStatus, keep_alive_of
from trio_llm.frontend.engine_client import EngineClient
from trio_llm.frontend.handle import EngineHandle
from trio_llm.frontend.lora_adapters import LoraAdapters
from trio_llm.lora_files import AdapterError

#: The kinds of model (`ModelStatus.kind`) that the pooling engine serves: no KV cache.
POOLING_KINDS = ("sentence-transformers", "cross-encoder")


class ModelRequest(RequestBody):
    """``POST /models/load`` and ``POST /models/unload``: which model (and for a load,
    Ollama's ``keep_alive``: how long it stays loaded when idle, from then on)."""

    model: Text


class LoadLoraRequest(RequestBody):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the adapter folder
    ``lora_path`` as ``lora_name``."""

    lora_name: Text
    lora_path: Text


class UnloadLoraRequest(RequestBody):
    """``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""

    lora_name: Text


def install_model_routes(
    app: FastAPI, router: ModelRouter, is_serving: Callable[[], bool], runtime_lora: bool = False
) -> None:
    """Add the routes of the module doc to ``app`` (``runtime_lora``: the adapter routes
    load and unload; else they answer 404)."""
    _add_health(app, router, is_serving)
    _add_models(app, router)
    _add_model_management(app, router)
    _add_adapter_routes(app, router, runtime_lora)


def _add_health(app: FastAPI, router: ModelRouter, is_serving: Callable[[], bool]) -> None:
    """``GET /health``: 200 while serving (a body when some engines or models do not),
    else 503."""

    @app.get("/health")
    async def health() -> Response:
        if router.several:
            if not is_serving() or router.ended.is_set():
                return _unavailable("the server is shutting down")
            return JSONResponse(_models_health(router.statuses()), status_code=200)
        serving = router.statuses()[0].serving
        if serving is None:  # unloaded on request: loaded again by the next request
            if is_serving() and not router.ended.is_set():
                return Response(status_code=200)
            return _unavailable("the server is shutting down")
        return _engine_health(serving.engine, is_serving)


def _engine_health(engine: EngineHandle, is_serving: Callable[[], bool]) -> Response:
    """The ``/health`` answer of a server of one model, from its engine handle."""
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
    return _unavailable(reason)


def _unavailable(reason: str) -> Response:
    """The 503 of /health (an open route: the reason names no host path)."""
    return APIError(503, without_host_paths(reason), type="service_unavailable_error").response()


def _degraded(engines: list[EngineClient], serving: int) -> dict[str, Any]:
    """The /health body while some data-parallel engines do not serve: the count, and
    each engine's state (``serving``, ``restarting`` or ``failed``) with its last error."""
    states = []
    for rank, client in enumerate(engines):
        state = "serving" if client.is_alive else "restarting" if client.is_restarting else "failed"
        entry: dict[str, Any] = {"engine": rank, "state": state}
        if client.error is not None and not client.is_alive:
            entry["error"] = without_host_paths(str(client.error))
        states.append(entry)
    return {
        "status": "degraded",
        "engines_serving": serving,
        "data_parallel_size": len(engines),
        "engines": states,
    }


def _models_health(statuses: list[ModelStatus]) -> dict[str, Any]:
    """The /health body of a server of several models: ``ok`` unless a model failed or a
    loaded one's engines do not all serve (``degraded``), and each model's state."""
    models = []
    degraded = False
    for status in statuses:
        entry: dict[str, Any] = {"model": status.names[0], "state": status.state}
        if status.error is not None:
            entry["error"] = status.error
        if status.serving is not None:
            engines = status.serving.engine.engines
            serving = sum(client.is_alive for client in engines)
            entry["engines_serving"] = serving
            entry["data_parallel_size"] = len(engines)
            degraded |= serving < len(engines)
        degraded |= status.state == "failed"
        models.append(entry)
    return {"status": "degraded" if degraded else "ok", "models": models}


def _add_models(app: FastAPI, router: ModelRouter) -> None:
    """``GET /v1/models`` and ``GET /v1/models/{model}``: vLLM's model cards, and each
    model's ``status`` (llama.cpp's router field)."""
    created = int(time.time())

    def cards() -> dict[str, dict[str, Any]]:
        found = {}
        for status in router.statuses():
            for name in status.names:
                found[name] = _model_card(name, status, created)
            adapters = status.serving.adapters if status.serving is not None else None
            for ref in adapters or ():
                card = _model_card(ref.name, status, created)
                card.update(root=ref.path, parent=status.names[0], max_model_len=None)
                found.setdefault(ref.name, card)
        return found

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(cards().values())})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        card = cards().get(model)
        if card is None:
            raise unknown_model(model, router.names())
        return JSONResponse(card)


def _model_card(name: str, status: ModelStatus, created: int) -> dict[str, Any]:
    """vLLM's model card, field for field (clients that list models read these), and the
    model's ``status``. Its ``root`` is `ModelStatus.model` (never the folder the engine
    loaded: a GGUF file's conversion under the cache). An unloaded model's card has what
    the catalog knows (no ``max_model_len``)."""
    serving = status.serving
    root = status.model
    if serving is not None:
        info = serving.engine.info
        max_model_len, generates = info.max_model_len, info.task == "generate"
    else:
        max_model_len = None
        generates = status.kind not in POOLING_KINDS
    state: dict[str, Any] = {"value": status.state}
    if status.error is not None:
        state["error"] = status.error
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "trio_llm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": generates,
                "allow_logprobs": generates,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
        "status": state,
    }


def _add_model_management(app: FastAPI, router: ModelRouter) -> None:
    """llama.cpp's router routes: ``POST /models/load`` and ``POST /models/unload`` (a
    ``model`` each; ``{"success": true}`` once done) and ``POST /models/reload`` (read
    ``--models-dir`` again: the names added and removed)."""

    @app.post("/models/load")
    async def load(request: Request) -> JSONResponse:
        body = await router.parse(ModelRequest, request)
        extra = body.model_extra or {}
        await router.load(body.model, keep_alive_of(extra.get("keep_alive")))
        return JSONResponse({"success": True})

    @app.post("/models/unload")
    async def unload(request: Request) -> JSONResponse:
        body = await router.parse(ModelRequest, request)
        await router.unload(body.model)
        return JSONResponse({"success": True})

    @app.post("/models/reload")
    async def reload() -> JSONResponse:
        added, removed = await router.reload()
        return JSONResponse({"success": True, "added": added, "removed": removed})


def _add_adapter_routes(app: FastAPI, router: ModelRouter, runtime: bool) -> None:
    """vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: plain
    text on success, as vLLM answers; 400 naming the field for an adapter that cannot be
    served; 404 for an unknown name, and for both routes without ``runtime``."""

    async def adapters_of() -> LoraAdapters:
        if not runtime:
            message = "runtime LoRA adapter loads are off (--allow-runtime-lora-updating)"
            raise APIError(404, message, type="not_found_error")
        lease = await router.acquire(None)
        lease.release()  # the adapters outlive the lease: only the object is wanted
        adapters = lease.serving.adapters
        if adapters is None:
            raise APIError(400, "this model serves no LoRA adapters", param="lora_name")
        return adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        adapters = await adapters_of()
        body = await router.parse(LoadLoraRequest, request)
        add = partial(adapters.add, body.lora_name, body.lora_path, runtime=True)
        try:
            await trio.to_thread.run_sync(add)
        except AdapterError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        adapters = await adapters_of()
        body = await router.parse(UnloadLoraRequest, request)
        try:
            adapters.remove(body.lora_name)
        except KeyError:
            message = f"The lora adapter '{body.lora_name}' cannot be found."
            raise APIError(404, message, type="not_found_error", param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
