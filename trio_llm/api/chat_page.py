"""The browser chat page: ``GET /`` and its files under ``GET /static/{name}``.

The page (``trio_llm/static``) is plain HTML, CSS and JavaScript that talks to ``/v1/ws``.
Only the files named in `STATIC_FILES` are served, read once from the installed package, so
no request path ever reaches the file system. The routes sit outside ``/v1``, so the page
loads without the API key; the page sends the key itself when it opens the WebSocket.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from trio_llm.api.http.errors import APIError

#: Every file the page needs -> its content type. Nothing else under ``static/`` is served.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}

#: The page needs nothing from other origins: scripts, styles and the socket are all ours.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "content-security-policy": CONTENT_SECURITY_POLICY,
}


def read_static_files() -> dict[str, bytes]:
    """The bytes of every file in `STATIC_FILES`, read from the ``trio_llm`` package."""
    folder = resources.files("trio_llm").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in STATIC_FILES}


def install_chat_page(app: FastAPI) -> None:
    """Serve the chat page at ``GET /`` and its files at ``GET /static/{name}`` (``HEAD``
    too: Claude Code checks the server is there with ``HEAD /``).

    An unknown name answers 404 (an OpenAI-style error body, like every other route).
    The routes are left out of the OpenAPI schema.
    """
    files = read_static_files()

    def file_response(name: str) -> Response:
        return Response(files[name], media_type=STATIC_FILES[name], headers=_HEADERS)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return file_response("index.html")

    @app.api_route("/static/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"no static file named {name!r}", type="not_found_error")
        return file_response(name)
