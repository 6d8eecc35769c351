"""bench/agent_clients.py's report of a client killed while an answer still streams
(issue 41 item 18): the exchange in flight is named, not "no request reached the
server". A real proxy over a local upstream that streams until its client leaves."""

from __future__ import annotations

import http.client
import importlib.util
import socket
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agent_clients() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agent_clients", ROOT / "bench/agent_clients.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["agent_clients"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Endless(BaseHTTPRequestHandler):
    """Streams SSE events until the proxy's connection breaks."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"type": "content_block_delta"}\n\n'
        try:
            while True:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
        except OSError:
            pass


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_client_killed_mid_stream_is_reported_as_such(
    agent_clients: ModuleType, upstream: str
) -> None:
    recorder = agent_clients.Recorder()
    recorder.client = "claude"
    proxy = agent_clients.make_proxy(upstream, recorder)
    thread = threading.Thread(target=proxy.serve_forever)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1])
        body = b'{"model": "m", "stream": true, "max_tokens": 32000}'
        connection.request("POST", "/v1/messages", body=body)
        response = connection.getresponse()
        assert response.status == 200 and response.read1(100).startswith(b"data:")
        run = agent_clients.ClientRun("claude", None, "[timed out after 900 s]", 900.0)
        ok, why = agent_clients.verdict(run, recorder.of("claude"))
        assert not ok
        assert "no request reached the server" not in why
        assert "killed at its timeout" in why
        assert "exchange #1 was still being answered" in why and "max_tokens=32000" in why
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


def test_a_client_killed_before_any_request(agent_clients: ModuleType) -> None:
    run = agent_clients.ClientRun("codex", None, "", 900.0)
    ok, why = agent_clients.verdict(run, [])
    assert not ok and why.endswith("before any request reached the server")
