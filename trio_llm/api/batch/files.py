"""``/v1/files``: upload (``multipart/form-data``, as OpenAI's clients send it), list,
retrieve, download and delete files (`trio_llm.store.files`).

An upload is parsed as it arrives and its file part written straight to the store's folder
(`trio_llm.api.batch.file_upload`: its limits and its deadline), so no upload is ever held whole
in memory. It has its own size limit, ``--max-file-size`` (the general
``--max-request-body-bytes`` does not apply to this route: `OWN_BODY_LIMIT`).
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trio_llm.api.batch.file_upload import (
    MULTIPART_ALLOWANCE,
    MultipartUpload,
    multipart_boundary,
    receive_upload,
)
from trio_llm.api.http.errors import APIError
from trio_llm.api.http.store_routes import ListParams, need_store, stored_json
from trio_llm.api.model_router import ModelRouter
from trio_llm.server_config import ServerConfig
from trio_llm.store import Store
from trio_llm.store import files as stored
from trio_llm.store.batches import files_in_use
from trio_llm.store.objects import now

#: The route that enforces its own body limit (`BodySizeLimitMiddleware` skips it).
OWN_BODY_LIMIT = ("POST", "/v1/files")
#: Bytes read from disk per chunk of a download.
DOWNLOAD_CHUNK = 256 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the file is larger than this server's limit of {limit} bytes (--max-file-size)",
        param="file",
        code="file_too_large",
        headers={"Connection": "close"},
    )


def _write_failed(exc: OSError) -> APIError:
    """The error of an upload the store's folder could not take: 507 when the disk is
    full, else 503. The message names the error, never a path."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = exc.strerror or type(exc).__name__
    return APIError(
        507 if full else 503,
        f"the store cannot write the file: {reason}",
        type="server_error",
        code="store_unavailable",
    )


async def _receive_file(
    request: Request, store: Store, config: ServerConfig, file_id: str
) -> tuple[str, str, int]:
    """Write the upload's file under ``file_id``; its name, purpose and size in bytes.
    Nothing is left on disk when it fails."""
    limit = config.store.max_file_bytes
    boundary = multipart_boundary(request.headers.get("content-type"))
    writer: stored.FileWriter | None = None
    try:
        try:
            writer = await trio.to_thread.run_sync(
                stored.FileWriter, store.files_dir, file_id, limit
            )
            upload = MultipartUpload(writer, boundary)
            await receive_upload(
                request,
                upload,
                stall=config.request_body_timeout,
                min_rate=config.store.upload_min_rate,
            )
            filename, purpose = upload.fields()
            nbytes = await trio.to_thread.run_sync(writer.finish)
        except stored.FileTooLarge:
            raise _too_large(limit) from None
        except OSError as exc:
            raise _write_failed(exc) from None
    except BaseException:
        if writer is not None:
            await trio.to_thread.run_sync(writer.discard)
        raise
    return filename, purpose, nbytes


async def upload_file(request: Request, store: Store, config: ServerConfig) -> dict[str, Any]:
    """Store the file of a ``POST /v1/files`` request; return its File object.

    Raises:
        APIError: 400 for a malformed upload or a missing or unknown field; 413 (naming
            ``--max-file-size``) for a file over the limit, or for more than
            `MULTIPART_ALLOWANCE` bytes besides it; 408 for an upload too slow; 503 / 507
            when the store's folder cannot take it.
    """
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > config.store.max_file_bytes + MULTIPART_ALLOWANCE:
        raise _too_large(config.store.max_file_bytes)
    file_id = stored.new_file_id()
    filename, purpose, nbytes = await _receive_file(request, store, config, file_id)
    created = now()
    max_age = store.policy.max_age
    insert = partial(
        stored.insert_file,
        file_id=file_id,
        filename=filename or "file",
        purpose=purpose,
        nbytes=nbytes,
        created_at=created,
        expires_at=None if max_age is None else created + int(max_age),
    )
    try:
        return await store.transaction(insert)
    except BaseException:
        stored.content_path(store.files_dir, file_id).unlink(missing_ok=True)
        raise


async def _read_chunks(handle: Any) -> AsyncIterator[bytes]:
    """The chunks of an open file (closed at the end, or when the download stops)."""
    try:
        while chunk := await handle.read(DOWNLOAD_CHUNK):
            yield chunk
    finally:
        await handle.aclose()


def install_file_routes(app: FastAPI, router: ModelRouter, config: ServerConfig) -> None:
    """``/v1/files`` and the paths under it, on the server's store (``router.store``;
    refused without)."""

    def get_store() -> Store | None:
        return router.store

    @app.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        store = need_store(get_store(), "files")
        return JSONResponse(await upload_file(request, store, config))

    @app.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        store = need_store(get_store(), "files")
        params = ListParams.of(request, default_limit=10_000, max_limit=10_000)
        purpose = request.query_params.get("purpose")
        return await params.page(store, partial(stored.list_files, purpose=purpose))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> JSONResponse:
        return await stored_json(get_store(), "files", partial(stored.get_file, file_id=file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        store = need_store(get_store(), "files")
        await store.transaction(partial(stored.get_file, file_id=file_id))
        try:
            handle = await trio.open_file(stored.content_path(store.files_dir, file_id), "rb")
        except FileNotFoundError:
            # Removed between the lookup and the open: deleted or evicted meanwhile.
            await store.transaction(partial(stored.get_file, file_id=file_id))
            message = f"the contents of the file '{file_id}' are gone"
            raise APIError(404, message, type="not_found_error", code="not_found") from None
        return StreamingResponse(_read_chunks(handle), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> JSONResponse:
        store = need_store(get_store(), "files")

        def delete(tx: Any) -> None:
            stored.delete_file(tx, file_id, files_in_use(tx))

        try:
            await store.transaction(delete)
        except stored.FileInUse as exc:
            raise APIError(409, str(exc), param="file_id", code="file_in_use") from None
        await trio.to_thread.run_sync(
            partial(stored.content_path(store.files_dir, file_id).unlink, missing_ok=True)
        )
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
