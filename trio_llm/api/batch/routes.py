"""``/v1/batches``: create, retrieve, list and cancel batches (`trio_llm.store.batches`);
the `BatchRunner` of `trio_llm.api.batch.runner` runs them.

Creating a batch checks its request (the input file is stored and has purpose ``batch``,
the endpoint is one this server's model serves) and stores it as ``validating``; the
runner does the rest. `install_batch_routes` also makes the server's runner and keeps it
with the app (`batch_runner_of`), for the supervisor to start.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StringConstraints, model_validator

from trio_llm.api.batch.runner import BatchRunner
from trio_llm.api.chat.request_body import RequestBody, Text, refuse_unimplemented
from trio_llm.api.http.errors import APIError, bad_request
from trio_llm.api.http.store_routes import ListParams, need_store, stored_json
from trio_llm.api.model_router import ModelRouter, RouterEngines
from trio_llm.server_config import ServerConfig
from trio_llm.store import NotFound, Store
from trio_llm.store import batches as stored

#: Most ``metadata`` pairs, longest key and value (OpenAI's limits).
MAX_METADATA_PAIRS = 16
_Key = Annotated[Text, StringConstraints(max_length=64)]
_Value = Annotated[Text, StringConstraints(max_length=512)]

#: The task (`EngineReady.task`) each batch endpoint needs of the served model.
_ENDPOINT_TASKS = {
    "/v1/chat/completions": "generate",
    "/v1/completions": "generate",
    "/v1/responses": "generate",
    "/v1/embeddings": "embed",
}


class BatchRequest(RequestBody):
    """``POST /v1/batches`` (OpenAI's fields)."""

    input_file_id: Text
    endpoint: Literal[stored.ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal[tuple(stored.COMPLETION_WINDOWS)]  # type: ignore[valid-type]
    metadata: dict[_Key, _Value] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> BatchRequest:
        refuse_unimplemented(self.model_extra, {"output_expires_after": (None,)})
        return self


async def create_batch(request: BatchRequest, store: Store, router: ModelRouter) -> dict[str, Any]:
    """Store a new batch; return its object.

    Raises:
        APIError: 400 for an endpoint the served model does not serve (a server of one
            model; with several, each line's model answers its line) or an input file
            of another purpose; 404 naming ``input_file_id`` for a file not stored.
    """
    serving = None if router.several else router.statuses()[0].serving
    task = serving.engine.info.task if serving is not None else None
    if task is not None and _ENDPOINT_TASKS[request.endpoint] != task:
        kind = {"embed": "an embedding model", "score": "a cross-encoder"}.get(
            task, "a model that generates text"
        )
        message = f"the model served here is {kind}: it does not serve {request.endpoint}"
        raise bad_request(message, "endpoint")
    create = partial(
        stored.create_batch,
        input_file_id=request.input_file_id,
        endpoint=request.endpoint,
        completion_window=request.completion_window,
        metadata=request.metadata,
    )
    try:
        return await store.transaction(create)
    except NotFound as exc:
        raise APIError(
            404, str(exc), type="not_found_error", param="input_file_id", code="not_found"
        ) from None
    except stored.BatchConflict as exc:
        raise bad_request(str(exc), exc.param) from None


def install_batch_routes(app: FastAPI, router: ModelRouter, config: ServerConfig) -> None:
    """``/v1/batches`` and the paths under it, and the server's `BatchRunner` (with a
    store; `batch_runner_of`)."""

    def get_store() -> Store | None:
        return router.store

    runner = None
    if router.store is not None:
        max_in_flight = config.store.batch_max_in_flight or config.engine_slots()
        runner = BatchRunner(
            app,
            RouterEngines(router),
            router.store,
            max_in_flight=max_in_flight,
            api_key=config.api_key,
            max_waiting=config.max_num_waiting_requests,
        )
    app.state.batch_runner = runner

    def wake() -> None:
        if runner is not None:
            runner.wake()

    @app.post("/v1/batches")
    async def create(request: Request) -> JSONResponse:
        store = need_store(get_store(), "batches")
        body = await router.parse(BatchRequest, request)
        batch = await create_batch(body, store, router)
        wake()
        return JSONResponse(batch)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        store = need_store(get_store(), "batches")
        return await ListParams.of(request, orders=False).page(store, stored.list_batches)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str) -> JSONResponse:
        return await stored_json(
            get_store(), "batches", partial(stored.get_batch, batch_id=batch_id)
        )

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> JSONResponse:
        store = need_store(get_store(), "batches")
        try:
            batch = await store.transaction(partial(stored.request_cancel, batch_id=batch_id))
        except stored.BatchConflict as exc:
            raise APIError(409, str(exc), code="batch_not_cancellable") from None
        wake()
        return JSONResponse(batch)


def batch_runner_of(app: FastAPI) -> BatchRunner | None:
    """The `BatchRunner` `install_batch_routes` made for ``app`` (None without a store)."""
    return getattr(app.state, "batch_runner", None)
