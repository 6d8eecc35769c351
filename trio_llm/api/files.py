"""``/v1/files``: upload (``multipart/form-data``, as OpenAI's clients send it), list,
retrieve, download and delete files (`trio_llm.store.files`).

An upload is parsed as it arrives (python-multipart's streaming parser, in worker
threads) and its file part written straight to the store's folder (`FileWriter`), so no
upload is ever held whole in memory. It has its own size limit, ``--max-file-size``
(the general ``--max-request-body-bytes`` does not apply to this route:
`OWN_BODY_LIMIT`).
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import trio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from trio_llm.api.errors import APIError, bad_request
from trio_llm.api.model_router import ModelRouter
from trio_llm.api.store_routes import ListParams, need_store, stored_json
from trio_llm.server_config import ServerConfig
from trio_llm.store import Store
from trio_llm.store import files as stored
from trio_llm.store.batches import files_in_use
from trio_llm.store.objects import now

#: The route that enforces its own body limit (`BodySizeLimitMiddleware` skips it).
OWN_BODY_LIMIT = ("POST", "/v1/files")
#: Bytes an upload's body may have besides the file's own (boundaries, headers, purpose).
MULTIPART_ALLOWANCE = 64 * 1024
#: Longest value of a form field other than the file.
MAX_FIELD_BYTES = 1024
#: Bytes read from disk per chunk of a download.
DOWNLOAD_CHUNK = 256 * 1024


class _Upload:
    """The state of one ``multipart/form-data`` upload as python-multipart parses it: the
    ``file`` part goes to a `FileWriter`, other fields are kept (short) in memory."""

    def __init__(self, files_dir: Path, file_id: str, max_bytes: int, boundary: bytes) -> None:
        self.writer = stored.FileWriter(files_dir, file_id, max_bytes)
        self.filename: str | None = None
        self.fields: dict[str, bytes] = {}
        self.ended = False
        self._headers: dict[bytes, bytes] = {}
        self._field: bytes = b""
        self._value: bytes = b""
        self._name: str | None = None
        self._is_file = False
        self._header_name = b""
        callbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }
        self.parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]

    def _part_begin(self) -> None:
        self._headers, self._value, self._header_name, self._field = {}, b"", b"", b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._field
        self._header_name, self._field = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        self._name = name
        self._is_file = name == "file"
        if self._is_file:
            if self.filename is not None:
                raise bad_request("the upload has more than one `file` part", "file")
            try:
                self.filename = options.get(b"filename", b"").decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request("the file's name is not valid UTF-8", "file") from None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.writer.write(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise bad_request(f"the form field `{self._name}` is too long", self._name)

    def _part_end(self) -> None:
        if not self._is_file and self._name is not None:
            self.fields[self._name] = self._value

    def _end(self) -> None:
        self.ended = True

    def feed(self, chunk: bytes) -> None:
        """Parse (and write) one chunk of the body (blocking).

        Raises:
            APIError: 400 for a malformed body.
            FileTooLarge: the file part passed ``max_bytes``.
        """
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise bad_request(f"the multipart/form-data body is malformed: {exc}") from None


def _boundary(request: Request) -> bytes:
    kind, options = parse_options_header(request.headers.get("content-type"))
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise bad_request(
            "POST /v1/files takes a multipart/form-data body with the fields `file` and `purpose`"
        )
    return options[b"boundary"]


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the file is larger than this server's limit of {limit} bytes (--max-file-size)",
        param="file",
        code="file_too_large",
        headers={"Connection": "close"},
    )


def _write_failed(exc: OSError) -> APIError:
    """The error of an upload the disk could not take: 507 when it is full."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return APIError(
        507 if full else 500,
        f"the store cannot write the file: {exc.strerror or exc}",
        type="server_error",
        code="store_unavailable",
    )


async def _receive_upload(request: Request, upload: _Upload, stall: float) -> None:
    """Feed the body to ``upload`` chunk by chunk, each within ``stall`` seconds."""
    chunks = request.stream().__aiter__()
    while True:
        try:
            with trio.fail_after(stall):
                chunk = await chunks.__anext__()
        except StopAsyncIteration:
            break
        except trio.TooSlowError:
            message = f"the upload stalled for {stall:g} s (--request-body-timeout)"
            raise APIError(408, message, code="request_timeout") from None
        except ClientDisconnect:
            raise APIError(499, "the client closed the request") from None
        if chunk:
            await trio.to_thread.run_sync(upload.feed, chunk)


def _check_fields(upload: _Upload) -> str:
    """The upload's purpose, once its fields are checked."""
    for name in upload.fields:
        if name != "purpose":
            message = f"the form field `{name}` is not supported by this server"
            raise bad_request(message, name.split("[", 1)[0])
    if not upload.ended or upload.filename is None:
        raise bad_request("the upload has no `file` part (or it was cut short)", "file")
    allowed = ", ".join(repr(p) for p in stored.UPLOAD_PURPOSES)
    if "purpose" not in upload.fields:
        raise bad_request(f"the form field `purpose` is required: one of {allowed}", "purpose")
    purpose = upload.fields["purpose"].decode("utf-8", "replace")
    if purpose not in stored.UPLOAD_PURPOSES:
        raise bad_request(f"purpose must be one of {allowed}, not {purpose!r}", "purpose")
    return purpose


async def upload_file(request: Request, store: Store, config: ServerConfig) -> dict[str, Any]:
    """Store the file of a ``POST /v1/files`` request; return its File object.

    Raises:
        APIError: 400 for a malformed upload or a missing or unknown field; 413 (naming
            ``--max-file-size``) for a file over the limit; 408 for a stalled upload.
    """
    limit = config.store.max_file_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit + MULTIPART_ALLOWANCE:
        raise _too_large(limit)
    boundary = _boundary(request)
    file_id = stored.new_file_id()
    upload = await trio.to_thread.run_sync(_Upload, store.files_dir, file_id, limit, boundary)
    try:
        try:
            await _receive_upload(request, upload, config.request_body_timeout)
            purpose = _check_fields(upload)
            nbytes = await trio.to_thread.run_sync(upload.writer.finish)
        except stored.FileTooLarge:
            raise _too_large(limit) from None
        except OSError as exc:
            raise _write_failed(exc) from exc
    except BaseException:
        await trio.to_thread.run_sync(upload.writer.discard)
        raise
    created = now()
    max_age = store.policy.max_age
    insert = partial(
        stored.insert_file,
        file_id=file_id,
        filename=upload.filename or "file",
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
