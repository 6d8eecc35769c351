"""The WebSocket handshake's checks (``/v1/ws``, see ``docs/websocket.md``): whether the
page's ``Origin`` may connect, and whether the client presents the API key."""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.websockets import WebSocket


def origin_allowed(headers: Headers, allowed_origins: tuple[str, ...]) -> bool:
    """Whether a WebSocket handshake with these headers may connect.

    Browsers always send one ``Origin``; other clients usually send none, and are
    allowed; more than one is refused. With ``--allowed-origins`` the origin must be one
    of them (or the list holds ``*``), as for CORS over HTTP. Without it only same-origin
    pages are allowed (the chat page served at ``/``): the origin's host and port must be
    the ``Host`` the browser connected to, and that host must be an IP address or
    ``localhost``. A page can rebind its own domain name to 127.0.0.1 (DNS rebinding) and
    then looks same-origin to the server; naming a server by a domain therefore takes
    ``--allowed-origins``.
    """
    origins = headers.getlist("origin")
    if not origins:
        return True
    if len(origins) > 1:
        return False
    origin = origins[0]
    if allowed_origins:
        return "*" in allowed_origins or origin.rstrip("/") in {
            allowed.rstrip("/") for allowed in allowed_origins
        }
    try:
        parts = urlsplit(origin)
        origin_host = parts.netloc.lower()
        hostname = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not origin_host or not _is_local_name(hostname):
        return False
    host = headers.get("host", "").lower()
    default_port = ":443" if parts.scheme == "https" else ":80"
    return origin_host in (host, host.removesuffix(default_port)) or (
        f"{origin_host}{default_port}" == host
    )


def _is_local_name(hostname: str) -> bool:
    """An IP address literal or ``localhost``: names no other site can point at us."""
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return True


def authorized(websocket: WebSocket, key: bytes) -> bool:
    """Whether the handshake carries ``key`` as the HTTP routes take it (a bearer token or
    ``x-api-key``, see `trio_llm.api.http.middleware.APIKeyMiddleware`) or as ``?api_key=``."""
    header_key = websocket.headers.get("x-api-key")
    if header_key is not None and hmac.compare_digest(header_key.strip().encode("latin-1"), key):
        return True
    scheme, _, token = websocket.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), key):
        return True
    query = websocket.query_params.get("api_key")
    return query is not None and hmac.compare_digest(query.encode(), key)
