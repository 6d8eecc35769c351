"""Claude Code and Codex CLI against trio_llm, with their default settings, through a
recording proxy: every exchange's method, path, status and error, in a table.

Opt-in (not part of ``make test``): it installs both clients from npm (about 650 MB, into
``--npm-dir``, cached between runs) and runs each once::

    # start a server of its own (default model, as `make serve`) on a free port
    HF_HUB_OFFLINE=1 .venv/bin/python bench/agent_clients.py
    # or use one that runs already
    .venv/bin/python bench/agent_clients.py --url http://127.0.0.1:8000
    # Gemma 3 270M (32k context; `make gemma3` first): Claude Code's whole first request
    HF_HUB_OFFLINE=1 .venv/bin/python bench/agent_clients.py --model gemma-3-270m \\
        --server-arg=--chat-template=bench/data/gemma3_tools.jinja

What runs:

- ``claude -p PROMPT`` with ``ANTHROPIC_BASE_URL`` (the proxy), ``ANTHROPIC_API_KEY=dummy``
  and ``ANTHROPIC_MODEL`` (the served model), in a scratch ``CLAUDE_CONFIG_DIR`` and
  working folder;
- ``codex exec PROMPT`` in a scratch git repository with a scratch ``CODEX_HOME`` whose
  ``config.toml`` names one custom model provider (``base_url`` the proxy's ``/v1``,
  ``wire_api = "responses"``) and the served model.

Nothing else is configured: the requests are what each client sends by default.

The proxy (stdlib, one thread per connection) forwards every request unchanged and
streams every answer back unchanged; it records the request body (``--save-requests DIR``
writes each one as ``<client>-<n>.json``), the status, the time to the first body byte
(for a stream: the time to first token, prefill included), the SSE event names of a
stream and, for an error (a 4xx/5xx status or an error event inside a 200 stream), the
error body.

Outcome (exit status): 0 when every exchange was a 2xx and every client exited 0; also
0 where the only errors were context-length errors (the server's context is smaller than
the client's prompt, e.g. SmolLM2's 8,192 tokens against Claude Code's ~20,000) *and* the
client showed them in its own words (Claude Code: "Prompt is too long", Codex: "ran out of
room in the model's context window") rather than as raw JSON. Anything else is 1. What each
client printed is shown below its table. An exchange is recorded when its request arrives:
a client killed at ``--timeout`` while an answer still streams is reported as such (that
exchange's row ends in ``+``: its time so far).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))

#: The npm packages and the version line each was tried with (issue 31).
NPM_PACKAGES = ["@anthropic-ai/claude-code", "@openai/codex"]
DEFAULT_NPM_DIR = Path(tempfile.gettempdir()) / "trio_llm_agent_clients"

#: What a context-length error says on the wire (OpenAI / vLLM, the Responses code,
#: Anthropic).
CONTEXT_ERROR = re.compile(
    r"maximum context length|context_length_exceeded|prompt is too long", re.IGNORECASE
)
#: How each client tells its user about a context-length error, in its own words (the
#: strings are the clients' own: Claude Code's ``Prompt is too long`` message, Codex's
#: ``ContextWindowExceeded`` text).
CLIENT_CONTEXT_WORDS = {
    "claude": re.compile(r"Prompt is too long"),
    "codex": re.compile(r"ran out of room in the model's context window"),
}
#: SSE events that report a failure inside a 200 stream.
ERROR_EVENTS = {"error", "response.failed", "response.incomplete"}
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
}


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    client: str
    method: str
    path: str
    request_body: bytes
    request_headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    seconds: float = 0.0
    first_byte_s: float | None = None
    first_delta_s: float | None = None
    events: list[str] = field(default_factory=list)
    usage: dict | None = None
    error: str = ""
    response_head: bytes = b""
    #: When the proxy received it (``time.monotonic``).
    started: float = field(default_factory=time.monotonic)
    #: The answer ended (or broke): False while it still streams.
    done: bool = False

    @property
    def failed(self) -> bool:
        """A 4xx/5xx status, no answer at all, or an error event inside the stream."""
        return self.status >= 400 or self.status == 0 or bool(set(self.events) & ERROR_EVENTS)

    def elapsed(self) -> float:
        """Its duration: to the end of its answer, or so far while it still streams."""
        return self.seconds if self.done else time.monotonic() - self.started

    @property
    def context_error(self) -> bool:
        """The failure is the server saying the prompt does not fit its context."""
        return self.failed and bool(CONTEXT_ERROR.search(self.error))

    def record(self, client_version: str) -> dict:
        """The request as a fixture: method, path, headers (the API key a dummy) and the
        JSON body, with Claude Code's per-install and per-session ids zeroed."""
        headers = {k: v for k, v in self.request_headers.items() if k.lower() not in _HOP_BY_HOP}
        headers.pop("Host", None)
        headers.pop("host", None)
        text = self.request_body.decode("utf-8", "replace")
        text = re.sub(r'(device_id\\?":\\?")[0-9a-f]{64}', lambda m: m.group(1) + "0" * 64, text)
        uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
        text = re.sub(uuid, "00000000-0000-4000-8000-000000000000", text)
        for key in headers:
            headers[key] = re.sub(uuid, "00000000-0000-4000-8000-000000000000", headers[key])
        try:
            body: object = json.loads(text)
        except ValueError:
            body = text
        note = f"{client_version}: {self.method} {self.path} as bench/agent_clients.py captured it"
        return {
            "note": note,
            "method": self.method,
            "path": self.path,
            "headers": headers,
            "body": body,
        }

    def request_summary(self) -> str:
        """Model, streaming, max_tokens, tool count and the request size of a JSON body."""
        try:
            body = json.loads(self.request_body)
        except ValueError:
            return f"{len(self.request_body)} B"
        if not isinstance(body, dict):
            return f"{len(self.request_body)} B"
        parts = [f"{len(self.request_body) // 1024} KiB"]
        for key in ("model", "max_tokens", "max_output_tokens", "stream"):
            if key in body:
                parts.append(f"{key}={body[key]}")
        if body.get("tools"):
            parts.append(f"tools={len(body['tools'])}")
        return " ".join(parts)


class Recorder:
    """The exchanges of every client, in arrival order (thread-safe); each is added when
    its request arrives, so one whose answer never ends (a client killed mid-stream) is
    there too, not ``done``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exchanges: list[Exchange] = []
        self.client = "?"

    def add(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)

    def of(self, client: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.client == client]


def _event_names(data: bytes) -> list[str]:
    """The ``event:`` names of an SSE body, or each data line's JSON ``type`` where a
    stream has no event lines (chat completions: none)."""
    text = data.decode("utf-8", "replace")
    names = re.findall(r"^event: ?(\S+)", text, re.MULTILINE)
    if names:
        return names
    types = []
    for line in re.findall(r"^data: ?(.*)$", text, re.MULTILINE):
        with contextlib.suppress(ValueError, AttributeError):
            types.append(json.loads(line).get("type") or "data")
    return types


#: A chunk of generated output in any API's stream (or a whole non-streamed answer).
_DELTA = re.compile(rb'"(content_block_delta|response\.output_text\.delta|delta|content)"')


def _last_usage(data: bytes) -> dict | None:
    """The last ``usage`` object of a JSON body or SSE stream (Messages: message_start's
    input counts merged with message_delta's output count)."""
    text = data.decode("utf-8", "replace")
    found: dict = {}
    for match in re.finditer(r'"usage":\s*(\{[^{}]*\})', text):
        with contextlib.suppress(ValueError):
            found.update({k: v for k, v in json.loads(match.group(1)).items() if v is not None})
    return found or None


def _error_text(data: bytes, events: list[str]) -> str:
    """The error body of a failed exchange (for a stream: the error event's data)."""
    text = data.decode("utf-8", "replace")
    if not events:
        return text.strip()[:2000]
    match = re.search(r"^event: ?(?:error|response\.failed)\s*\ndata: ?(.*)$", text, re.MULTILINE)
    return (match.group(1) if match else text[-2000:]).strip()[:2000]


def make_proxy(upstream: str, recorder: Recorder) -> ThreadingHTTPServer:
    """A recording HTTP proxy to ``upstream`` on a free 127.0.0.1 port (not yet serving:
    run its ``serve_forever`` in a thread)."""
    target = urllib.parse.urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            exchange = Exchange(recorder.client, self.command, self.path, body, dict(self.headers))
            started = exchange.started
            recorder.add(exchange)
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in (*_HOP_BY_HOP, "host")
            }
            headers["Host"] = target.netloc
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=3600)
            collected = bytearray()
            try:
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                exchange.status = response.status
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := response.read1(65536):
                    if exchange.first_byte_s is None:
                        exchange.first_byte_s = time.monotonic() - started
                    if exchange.first_delta_s is None and _DELTA.search(chunk):
                        exchange.first_delta_s = time.monotonic() - started
                    if len(collected) < 4 * 1024 * 1024:
                        collected += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError as exc:
                exchange.error = exchange.error or f"proxy: {exc!r}"
                self.close_connection = True
            finally:
                connection.close()
                exchange.seconds = time.monotonic() - started
                exchange.response_head = bytes(collected[:4096])
                is_stream = b"\nevent:" in collected or collected.startswith((b"event:", b"data:"))
                exchange.events = _event_names(bytes(collected)) if is_stream else []
                exchange.usage = _last_usage(bytes(collected))
                if exchange.failed and not exchange.error:
                    exchange.error = _error_text(bytes(collected), exchange.events)
                exchange.done = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def install_clients(npm_dir: Path) -> dict[str, Path]:
    """``claude`` and ``codex`` from npm into ``npm_dir`` (skipped where both are there).

    Raises:
        RuntimeError: npm is missing or failed.
    """
    bins = {
        "claude": npm_dir / "node_modules/.bin/claude",
        "codex": npm_dir / "node_modules/.bin/codex",
    }
    if all(path.exists() for path in bins.values()):
        return bins
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed (Node.js 18 or later is needed)")
    npm_dir.mkdir(parents=True, exist_ok=True)
    print(f"installing {' '.join(NPM_PACKAGES)} into {npm_dir} (about 650 MB)", flush=True)
    command = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(npm_dir), *NPM_PACKAGES]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not all(path.exists() for path in bins.values()):
        raise RuntimeError(f"npm install failed:\n{done.stdout}\n{done.stderr}")
    return bins


def served_model(url: str) -> tuple[str, int | None]:
    """The first model id of ``url``'s ``/v1/models`` and its ``max_model_len``."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        first = json.load(response)["data"][0]
    return first["id"], first.get("max_model_len")


@contextlib.contextmanager
def trio_llm_server(model: str | None, args: list[str], log_path: Path) -> Iterator[str]:
    """``trio-llm serve`` of this checkout on a free port (as `make serve`: the hermes tool
    parser) with ``args``; yields its URL."""
    from tests.support.server_process import ServerProcess

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if model:
        flags += ["--model", model]
    with ServerProcess([*flags, *args], log_path=log_path) as server:
        yield server.url


@dataclass
class ClientRun:
    """What one client did: its exit status, what it printed, how long it took."""

    name: str
    returncode: int | None
    output: str
    seconds: float
    version: str = ""


def run_claude(
    binary: Path, base_url: str, model: str, prompt: str, scratch: Path, timeout: float
) -> ClientRun:
    """``claude -p PROMPT`` against ``base_url`` with a scratch config folder."""
    home = scratch / "claude-config"
    work = scratch / "claude-work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "dummy",
        "ANTHROPIC_MODEL": model,
        "CLAUDE_CONFIG_DIR": str(home),
    }
    return _run("claude", [str(binary), "-p", prompt], env, work, timeout)


def run_codex(
    binary: Path, base_url: str, model: str, prompt: str, scratch: Path, timeout: float
) -> ClientRun:
    """``codex exec PROMPT`` in a scratch git repository, with a scratch ``CODEX_HOME``
    naming one custom provider (``wire_api = "responses"``) at ``base_url``."""
    home = scratch / "codex-home"
    work = scratch / "codex-work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "trio_llm"\n\n'
        "[model_providers.trio_llm]\n"
        'name = "trio_llm"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
    )
    env = {**os.environ, "CODEX_HOME": str(home)}
    return _run("codex", [str(binary), "exec", prompt], env, work, timeout)


def _run(
    name: str, command: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> ClientRun:
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = (_text(exc.stdout) + _text(exc.stderr)) + f"\n[timed out after {timeout:.0f} s]"
    seconds = time.monotonic() - started
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True, env=env)
    return ClientRun(name, returncode, output, seconds, version.stdout.strip())


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def verdict(run: ClientRun, exchanges: list[Exchange]) -> tuple[bool, str]:
    """Whether ``run`` counts as served, and why."""
    if run.returncode is None:  # killed at the --timeout
        return False, _killed(run, exchanges)
    failed = [e for e in exchanges if e.failed]
    if not exchanges:
        return False, "no request reached the server"
    if not failed:
        if run.returncode == 0:
            return True, f"{len(exchanges)} exchanges, all 2xx; the client exited 0"
        return False, f"all exchanges 2xx but the client exited {run.returncode}"
    if all(e.context_error for e in failed):
        if CLIENT_CONTEXT_WORDS[run.name].search(run.output):
            return True, "stopped at the context-length error, shown in the client's own words"
        return False, "context-length error, but the client did not recognise it (raw error shown)"
    statuses = ", ".join(str(e.status) for e in failed)
    return False, f"{len(failed)} failed exchanges ({statuses})"


def _killed(run: ClientRun, exchanges: list[Exchange]) -> str:
    """What was going on when the client was killed at its timeout."""
    why = f"the client was killed at its timeout ({run.seconds:.0f} s)"
    if not exchanges:
        return why + " before any request reached the server"
    streaming = [i for i, e in enumerate(exchanges, 1) if not e.done]
    if not streaming:
        return why + f" after {len(exchanges)} exchanges, none in flight"
    last = exchanges[streaming[-1] - 1]
    return why + (
        f" while exchange #{streaming[-1]} was still being answered ({last.elapsed():.0f} s "
        f"so far, status {last.status or 'not yet sent'}; {last.request_summary()})"
    )


def print_report(
    run: ClientRun, exchanges: list[Exchange], ok: bool, why: str, tail_lines: int
) -> None:
    """The client's exchanges as a table, then what it printed."""
    state = "OK" if ok else "FAIL"
    print(f"\n=== {run.name}: exit {run.returncode}, {run.seconds:.1f} s: {state}: {why}")
    head = ("#", "method", "path", "status", "ttfb_s", "ttft_s", "total_s")
    print("{:>2}  {:6} {:34} {:>6} {:>7} {:>7} {:>7}  request".format(*head))
    for i, e in enumerate(exchanges, 1):
        ttfb = f"{e.first_byte_s:.2f}" if e.first_byte_s is not None else "-"
        ttft = f"{e.first_delta_s:.2f}" if e.first_delta_s is not None else "-"
        total = f"{e.elapsed():.2f}" + ("" if e.done else "+")
        row = (i, e.method, e.path[:34], e.status, ttfb, ttft, total, e.request_summary())
        print("{:>2}  {:6} {:34} {:>6} {:>7} {:>7} {:>7}  {}".format(*row))
        if e.usage:
            print(f"{'':>4}usage: {json.dumps(e.usage)}")
        if e.events:
            print(f"{'':>4}events: {_squeeze(e.events)}")
        if not e.done:
            print(f"{'':>4}still being answered when the client ended")
        elif e.failed:
            print(f"{'':>4}error: {e.error[:600]}")
    lines = run.output.rstrip().splitlines()
    print(f"--- {run.name} printed ({len(lines)} lines; last {min(tail_lines, len(lines))}):")
    for line in lines[-tail_lines:]:
        print(f"    {line[:300]}")


def _squeeze(events: list[str]) -> str:
    """``a b b b c`` -> ``a b x3 c``."""
    out: list[str] = []
    for name in events:
        if out and out[-1].split(" x")[0] == name:
            count = int(out[-1].split(" x")[1]) + 1 if " x" in out[-1] else 2
            out[-1] = f"{name} x{count}"
        else:
            out.append(name)
    return " ".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (else one is started)")
    parser.add_argument(
        "--model", help="--model of the server started here (default: the default model)"
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the server started here (repeat; write --server-arg=--flag=value)",
    )
    parser.add_argument("--clients", default="claude,codex", help="comma-separated: claude, codex")
    parser.add_argument("--prompt", default="say hi")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per client")
    parser.add_argument("--npm-dir", type=Path, default=DEFAULT_NPM_DIR)
    parser.add_argument("--save-requests", type=Path, help="write each request body here")
    parser.add_argument(
        "--server-log", type=Path, help="the started server's log (default: scratch)"
    )
    parser.add_argument(
        "--tail", type=int, default=15, help="lines of each client's output to show"
    )
    args = parser.parse_args()
    bins = install_clients(args.npm_dir)
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agent-clients-")))
        if args.url:
            url = args.url.rstrip("/")
        else:
            print("starting trio-llm serve ...", flush=True)
            log = args.server_log or scratch / "server.log"
            url = stack.enter_context(trio_llm_server(args.model, args.server_arg, log))
        model, context = served_model(url)
        recorder = Recorder()
        proxy = make_proxy(url, recorder)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        stack.callback(proxy.shutdown)
        proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
        print(f"server {url} ({model}, context {context}); proxy {proxy_url}", flush=True)
        results = []
        for name in [c.strip() for c in args.clients.split(",") if c.strip()]:
            recorder.client = name
            runner = {"claude": run_claude, "codex": run_codex}[name]
            print(f"running {name} ...", flush=True)
            run = runner(bins[name], proxy_url, model, args.prompt, scratch, args.timeout)
            exchanges = recorder.of(name)
            ok, why = verdict(run, exchanges)
            print_report(run, exchanges, ok, why, args.tail)
            results.append(ok)
            if args.save_requests:
                args.save_requests.mkdir(parents=True, exist_ok=True)
                for i, e in enumerate(exchanges, 1):
                    if e.request_body:
                        record = e.record(run.version)
                        path = args.save_requests / f"{name}-{i}.json"
                        path.write_text(json.dumps(record, indent=1, ensure_ascii=False))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
