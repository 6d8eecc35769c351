"""The chat page at ``/``: its files over plain HTTP, then the page itself in headless Chromium.

The browser tests drive the real page against the real server (the session ``server``),
as a user would: type, press Send or Enter, watch the answer stream in, press Stop. They
use the system Chromium (``make browser`` installs Debian's package), never Playwright's
own browser downloads, and skip when the ``playwright`` package or ``chromium`` is missing.

Playwright's sync API runs its own event loop, so these are plain ``def`` tests, which
pytest-trio leaves alone. Waits are Playwright's auto-waiting assertions with a generous
timeout (the model runs on the CPU, maybe next to other tests), never sleeps.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI

from trio_llm.api.chat_page import STATIC_FILES, install_chat_page
from trio_llm.api.http.errors import install_error_handlers
from trio_llm.api.http.middleware import install_middleware
from trio_llm.server_config import ServerConfig

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the browser tests skip
    expect = sync_playwright = None

#: Longest wait for anything in the page (ms): a CPU shared with other tests can be slow.
TIMEOUT_MS = 180_000

#: A question SmolLM2 answers at length when decoding greedily (300 tokens, no EOS).
LONG_QUESTION = "Write a long story about a dragon who learns to fly."


# ---------------------------------------------------------------- plain HTTP


def _raw_get(base_url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client-side ``..`` clean-up)."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_page_and_its_files_are_served_with_their_content_types(base_url: str) -> None:
    page = httpx.get(f"{base_url}/", timeout=30)
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script src="/static/chat.js"' in page.text
    assert 'href="/static/chat.css"' in page.text
    expected = {"chat.js": "text/javascript", "chat.css": "text/css", "index.html": "text/html"}
    assert set(expected) == set(STATIC_FILES)
    for name, content_type in expected.items():
        response = httpx.get(f"{base_url}/static/{name}", timeout=30)
        assert response.status_code == 200, name
        assert response.headers["content-type"] == f"{content_type}; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.content
    missing = httpx.get(f"{base_url}/static/missing.js", timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "path",
    [
        "/static/../pyproject.toml",
        "/static/../trio_llm/api/app.py",
        "/static/..%2Fapi%2Fapp.py",
        "/static/%2e%2e%2fapi%2fchat_page.py",
        "/static/..",
        "/static/__init__.py",
        "/static/",
    ],
)
def test_no_other_file_is_served(base_url: str, path: str) -> None:
    status, body = _raw_get(base_url, path)
    assert status == 404, (path, body[:200])
    assert b"import" not in body


async def test_the_page_needs_no_api_key_but_v1_still_does() -> None:
    app = FastAPI()
    install_error_handlers(app)
    install_middleware(app, ServerConfig(api_key="sk-chat-page-test"))
    install_chat_page(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/static/chat.js")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401
        schema = (await client.get("/openapi.json")).json()
    assert "/" not in schema["paths"]
    assert "/static/{name}" not in schema["paths"]


# ---------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def browser(detokenizer_mode: str) -> Iterator[Any]:
    """Headless system Chromium driven by Playwright (skips when either is missing).

    The browser tests run against the 2-process server only: the page is the same in
    both modes, and /v1/ws under it is tested in both (tests/e2e/test_websocket.py).
    """
    if detokenizer_mode != "inline":
        pytest.skip("browser tests run in inline mode; /v1/ws is tested in both modes")
    if sync_playwright is None:
        pytest.skip("the playwright package is not installed (pip install playwright)")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("no `chromium` on PATH (`make browser`, as root, installs it)")
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=executable, headless=True, args=["--disable-dev-shm-usage"]
        )
        yield chromium
        chromium.close()


@dataclass
class Chat:
    """The chat page open in a browser tab, and the WebSocket frames it sent."""

    page: Any
    sent: list[dict] = field(default_factory=list)
    page_errors: list[Exception] = field(default_factory=list)

    def chat_frames(self) -> list[dict]:
        """The ``chat`` frames sent so far, in order."""
        return [frame for frame in self.sent if frame.get("type") == "chat"]

    def set_controls(self, max_tokens: str, temperature: str = "0") -> None:
        """Fill in the max_tokens and temperature fields."""
        self.page.locator("#max-tokens").fill(max_tokens)
        self.page.locator("#temperature").fill(temperature)

    def ask(self, question: str) -> Any:
        """Type ``question``, press Send; the locator of the new answer."""
        previous = self.page.locator(".message.assistant").count()
        self.page.locator("#prompt").fill(question)
        self.page.locator("#send").click()
        answer = self.page.locator(".message.assistant").nth(previous)
        expect(answer).to_be_attached()
        return answer

    def expect_idle(self) -> None:
        """No answer is running: Send is enabled, Stop disabled."""
        expect(self.page.locator("#send")).to_be_enabled()
        expect(self.page.locator("#stop")).to_be_disabled()


def _open_chat(browser: Any, base_url: str, route: Callable[[Any], None] | None = None) -> Chat:
    context = browser.new_context(base_url=base_url)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    chat = Chat(page)
    page.on("pageerror", lambda error: chat.page_errors.append(error))

    def on_websocket(socket: Any) -> None:
        socket.on("framesent", lambda payload: chat.sent.append(json.loads(payload)))

    page.on("websocket", on_websocket)
    if route is not None:
        page.route_web_socket(re.compile(r"/v1/ws"), route)
    page.goto("/")
    return chat


@pytest.fixture
def chat(browser: Any, base_url: str) -> Iterator[Chat]:
    """The page, connected to the server's ``/v1/ws``."""
    opened = _open_chat(browser, base_url)
    expect(opened.page.locator("#status")).to_have_attribute("data-state", "open")
    yield opened
    opened.page.context.close()
    assert not opened.page_errors


def _expect_stats(answer: Any) -> int:
    """The answer shows TTFT and tok/s; returns its number of output tokens."""
    stats = answer.locator(".stats")
    expect(stats.locator(".ttft")).to_have_text(re.compile(r"^TTFT \d+ ms$"))
    expect(stats.locator(".tps")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    tokens = stats.locator(".tokens").text_content()
    match = re.fullmatch(r"(\d+) tokens?", tokens or "")
    assert match, tokens
    return int(match.group(1))


def test_a_short_answer_streams_in_with_its_stats_and_the_history_is_sent(chat: Chat) -> None:
    page = chat.page
    chat.set_controls(max_tokens="8")
    page.locator("#prompt").fill("What is the capital of France?")
    page.locator("#prompt").press("Enter")
    expect(page.locator(".message.user")).to_have_text("What is the capital of France?")
    first = page.locator(".message.assistant").first
    expect(first).to_have_attribute("data-state", "done")
    expect(first.locator(".content")).to_have_text(re.compile(r"\S"))
    expect(first.locator(".finish")).to_have_text(re.compile(r"^finish: (length|stop)$"))
    assert 1 <= _expect_stats(first) <= 8
    chat.expect_idle()
    first_answer = first.locator(".content").text_content()

    # Shift+Enter is a new line, not a send; the second question carries the history.
    page.locator("#prompt").fill("And of Germany?")
    page.locator("#prompt").press("Shift+Enter")
    page.locator("#prompt").press_sequentially("One word.")
    expect(page.locator("#prompt")).to_have_value("And of Germany?\nOne word.")
    assert page.locator(".message.user").count() == 1
    page.locator("#send").click()
    second = page.locator(".message.assistant").nth(1)
    expect(second).to_have_attribute("data-state", "done")
    _expect_stats(second)
    frames = chat.chat_frames()
    assert [frame["max_tokens"] for frame in frames] == [8, 8]
    assert [frame["temperature"] for frame in frames] == [0, 0]
    assert frames[1]["messages"] == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "And of Germany?\nOne word."},
    ]


def test_stop_ends_a_long_answer_while_it_streams(chat: Chat) -> None:
    page = chat.page
    chat.set_controls(max_tokens="300")
    answer = chat.ask(LONG_QUESTION)
    expect(page.locator("#stop")).to_be_enabled()
    expect(page.locator("#send")).to_be_disabled()
    content = answer.locator(".content")
    expect(content).to_have_text(re.compile(r"\w"))
    # It keeps growing: wait for more text than there is now.
    length = len(content.text_content() or "")
    page.wait_for_function(
        "([node, length]) => node.textContent.length > length",
        arg=[content.element_handle(), length],
        timeout=TIMEOUT_MS,
    )
    expect(answer).to_have_attribute("data-state", "streaming")
    page.locator("#stop").click()

    expect(answer).to_have_attribute("data-state", "stopped")
    expect(answer.locator(".stopped")).to_have_text("stopped")
    assert 2 <= _expect_stats(answer) < 300
    chat.expect_idle()
    (request,) = chat.chat_frames()
    assert {"type": "cancel", "id": request["id"]} in chat.sent


def test_an_invalid_max_tokens_is_shown_as_an_error_and_the_page_goes_on(chat: Chat) -> None:
    page = chat.page
    chat.set_controls(max_tokens="-1")
    answer = chat.ask("Hello!")
    expect(answer).to_have_attribute("data-state", "error")
    error = answer.locator(".error")
    expect(error).to_contain_text("max_tokens")
    expect(error).to_contain_text("invalid_request_error")
    chat.expect_idle()
    expect(page.locator("#prompt")).to_have_value("Hello!")  # put back, to retry

    chat.set_controls(max_tokens="3")
    page.locator("#send").click()
    retry = page.locator(".message.assistant").nth(1)
    expect(retry).to_have_attribute("data-state", "done")
    # The failed turn is not part of the conversation.
    assert chat.chat_frames()[1]["messages"] == [{"role": "user", "content": "Hello!"}]


def test_a_refused_api_key_is_shown_and_a_new_key_reconnects(browser: Any, base_url: str) -> None:
    # The WebSocket is played by Playwright: it refuses (1008) unless the key is "secret",
    # and passes the connection on to the real server when it is.
    urls: list[str] = []

    def route(socket: Any) -> None:
        urls.append(socket.url)
        if "api_key=secret" in socket.url:
            socket.connect_to_server()
        else:
            socket.close(code=1008, reason="invalid or missing API key")

    chat = _open_chat(browser, base_url, route)
    page = chat.page
    try:
        expect(page.locator(".message.notice .error")).to_contain_text(
            "invalid or missing API key (code 1008)"
        )
        expect(page.locator("#status")).to_have_attribute("data-state", "closed")
        assert len(urls) == 1  # a refused key is not retried on its own
        assert "api_key" not in urls[0]

        page.locator("#api-key").fill("secret")
        page.locator("#api-key").press("Enter")
        expect(page.locator("#status")).to_have_attribute("data-state", "open")
        assert "api_key=secret" in urls[-1]
        assert page.evaluate("localStorage.getItem('trio_llm.api_key')") == "secret"

        chat.set_controls(max_tokens="2")
        answer = chat.ask("Hi")
        expect(answer).to_have_attribute("data-state", "done")

        page.reload()
        expect(page.locator("#api-key")).to_have_value("secret")
        expect(page.locator("#status")).to_have_attribute("data-state", "open")
    finally:
        page.context.close()
    assert not chat.page_errors
