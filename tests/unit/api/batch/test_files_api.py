"""``/v1/files`` without an engine: the multipart upload streamed to the store under its
own limit (not ``--max-request-body-bytes``), and the routes' answers
(`trio_llm.api.batch.files`, on the `store` fixture)."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from trio_llm.api.batch.files import install_file_routes
from trio_llm.api.http.errors import install_error_handlers
from trio_llm.api.http.middleware import install_middleware
from trio_llm.server_config import ServerConfig, StoreConfig
from trio_llm.store import Store
from trio_llm.store.files import FileWriter

MAX_FILE = 1000
MAX_BODY = 100


def _app(store: Store | None) -> FastAPI:
    config = ServerConfig(
        max_request_body_bytes=MAX_BODY, store=StoreConfig(max_file_bytes=MAX_FILE)
    )
    app = FastAPI()
    install_error_handlers(app)
    install_middleware(app, config)
    install_file_routes(app, SimpleNamespace(store=store), config)  # type: ignore[arg-type]
    return app


@pytest.fixture
async def client(store: Store) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_an_upload_past_the_body_limit_is_stored_whole(
    client: httpx.AsyncClient, store: Store
) -> None:
    data = bytes(range(256)) * 3  # 768 bytes: past --max-request-body-bytes, within the file limit
    answer = await client.post(
        "/v1/files", files={"file": ("x.bin", data)}, data={"purpose": "user_data"}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["bytes"], body["filename"], body["purpose"]) == (768, "x.bin", "user_data")
    assert (store.files_dir / body["id"]).read_bytes() == data
    content = await client.get(f"/v1/files/{body['id']}/content")
    assert content.content == data
    # Any other route keeps the general limit.
    other = await client.post("/v1/files/x", content=b"y" * (MAX_BODY + 1))
    assert other.status_code == 413 and "request_too_large" in other.text


async def test_a_file_past_its_limit_is_a_413_naming_the_flag_and_leaves_nothing(
    client: httpx.AsyncClient, store: Store
) -> None:
    answer = await client.post(
        "/v1/files", files={"file": ("big", b"z" * (MAX_FILE + 1))}, data={"purpose": "batch"}
    )
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file"
    assert "--max-file-size" in error["message"] and str(MAX_FILE) in error["message"]
    assert answer.headers["connection"] == "close"
    assert list(store.files_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("form", "files", "param"),
    [
        ({"purpose": "fine-tune"}, {"file": ("a", b"x")}, "purpose"),
        ({}, {"file": ("a", b"x")}, "purpose"),
        ({"purpose": "batch"}, {"other": ("a", b"x")}, "other"),
        (
            {"purpose": "batch", "expires_after[seconds]": "3600"},
            {"file": ("a", b"x")},
            "expires_after",
        ),
    ],
)
async def test_a_bad_upload_is_a_400_naming_the_field(
    client: httpx.AsyncClient, store: Store, form, files, param
) -> None:
    answer = await client.post("/v1/files", files=files, data=form)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert list(store.files_dir.iterdir()) == []


async def test_not_multipart_is_refused(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/files", json={"purpose": "batch"})
    assert answer.status_code == 400 and "multipart/form-data" in answer.text
    cut = await client.post(
        "/v1/files",
        content=b"--b\r\nContent-Disposition: form-data; name=file; filename=a\r\n\r\nxx",
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert cut.status_code == 400 and cut.json()["error"]["param"] == "file"


async def test_lists_pages_and_deletes(client: httpx.AsyncClient, store: Store) -> None:
    ids = []
    for name in ("a", "b", "c"):
        answer = await client.post(
            "/v1/files", files={"file": (name, name.encode())}, data={"purpose": "batch"}
        )
        ids.append(answer.json()["id"])
    page = (await client.get("/v1/files", params={"limit": 2, "order": "asc"})).json()
    assert page["object"] == "list" and page["has_more"]
    assert [f["filename"] for f in page["data"]] == ["a", "b"]
    rest = (await client.get("/v1/files", params={"order": "asc", "after": page["last_id"]})).json()
    assert [f["filename"] for f in rest["data"]] == ["c"] and not rest["has_more"]
    for query, param in (({"limit": "0"}, "limit"), ({"order": "up"}, "order")):
        refused = await client.get("/v1/files", params=query)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    deleted = await client.delete(f"/v1/files/{ids[0]}")
    assert deleted.json() == {"id": ids[0], "object": "file", "deleted": True}
    assert not (store.files_dir / ids[0]).exists()
    gone = await client.get(f"/v1/files/{ids[0]}")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


async def test_without_a_store_the_routes_say_so() -> None:
    transport = httpx.ASGITransport(app=_app(None))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        answer = await http.get("/v1/files")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "store_disabled"
    assert "--store-url none" in answer.json()["error"]["message"]


async def test_a_full_disk_is_a_507_and_leaves_nothing(
    client: httpx.AsyncClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileWriter, "write", full)
    answer = await client.post("/v1/files", files={"file": ("a", b"x")}, data={"purpose": "batch"})
    assert answer.status_code == 507
    assert answer.json()["error"]["code"] == "store_unavailable"
    assert "No space left" in answer.json()["error"]["message"]
    assert list(store.files_dir.iterdir()) == []
    assert (await client.get("/v1/files")).json()["data"] == []
