"""The batch runner without an engine: lines parsed, run through a stand-in ASGI app,
recorded once, resumed, cancelled, expired, retried while the engine restarts
(`trio_llm.api.batch.lines`, `trio_llm.api.batch.line_runner`, `trio_llm.api.batch.runner`),
on the `store` fixture."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio

from trio_llm.api.batch import line_runner
from trio_llm.api.batch import runner as runner_module
from trio_llm.api.batch.line_runner import LineRunner
from trio_llm.api.batch.lines import (
    BATCH_LANE,
    LANE_SCOPE_KEY,
    LineError,
    LineRequest,
    call_app,
    check_input,
    parse_line,
)
from trio_llm.api.batch.runner import BatchRunner
from trio_llm.errors import EngineDeadError
from trio_llm.store import Store, StoreUnavailable
from trio_llm.store import batches as stored
from trio_llm.store import files as stored_files
from trio_llm.store.objects import now

ENDPOINT = "/v1/completions"


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": ENDPOINT,
        "body": {"prompt": "p", **body},
    }


# ------------------------------------------------------------------ input lines


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_request", None),
        (
            json.dumps({"method": "POST", "url": ENDPOINT, "body": {}}).encode(),
            "invalid_request",
            "custom_id",
        ),
        (json.dumps(_line("a") | {"extra": 1}).encode(), "invalid_request", "extra"),
        (json.dumps(_line("a") | {"method": "GET"}).encode(), "invalid_method", "method"),
        (json.dumps(_line("a") | {"url": "/v1/embeddings"}).encode(), "invalid_url", "url"),
        (json.dumps(_line("a") | {"body": "text"}).encode(), "invalid_request", "body"),
        (json.dumps(_line("a", stream=True)).encode(), "invalid_request", "body.stream"),
        (b"[" * 100_000, "invalid_json", None),
    ],
)
def test_a_line_that_cannot_run_is_a_line_error_naming_why(
    raw: bytes, code: str, param: str | None
) -> None:
    parsed = parse_line(6, raw, (ENDPOINT,))
    assert isinstance(parsed, LineError)
    assert (parsed.code, parsed.param, parsed.index) == (code, param, 6)
    assert "line 7" in parsed.message


def test_a_good_line_carries_its_body_as_json() -> None:
    raw = json.dumps(_line("x", max_tokens=3, stop="\ud800")).encode()
    parsed = parse_line(0, raw, (ENDPOINT,))
    assert isinstance(parsed, LineRequest) and parsed.custom_id == "x"
    # ASCII JSON: the lone surrogate reaches the request path as the escape it was.
    assert json.loads(parsed.body) == {"prompt": "p", "max_tokens": 3, "stop": "\ud800"}
    assert b"\\ud800" in parsed.body


def test_the_input_file_checks_list_duplicates_and_count_blank_lines_out(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [_line("a"), _line("b"), _line("a"), _line("c"), _line("b")]
    path.write_text(
        "\n".join(json.dumps(line) for line in lines[:2])
        + "\n\n"
        + "\n".join(json.dumps(line) for line in lines[2:])
        + "\nnot json\n"
    )
    total, errors = check_input(path)
    assert total == 6
    assert [(e["code"], e["line"]) for e in errors] == [
        ("duplicate_custom_id", 3),
        ("duplicate_custom_id", 5),
    ]
    path.write_text("\n  \n")
    assert check_input(path)[1][0]["code"] == "empty_file"


# ------------------------------------------------------------------ a stand-in app


class FakeClient:
    def __init__(self) -> None:
        self.num_restarts = 0
        self.error: Exception | None = None


class FakeEngine:
    """What `LineRunner` reads of an `EngineHandle`."""

    def __init__(self) -> None:
        self.client = FakeClient()
        self.ended = trio.Event()
        self.num_waiting = 0

    @property
    def engines(self) -> list[FakeClient]:
        return [self.client]

    @property
    def is_alive(self) -> bool:
        return self.client.error is None and not self.ended.is_set()

    @property
    def error(self) -> Exception | None:
        return self.client.error


Answer = Callable[[dict[str, Any], dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


class FakeApp:
    """An ASGI app that answers each request with ``answer(scope, body)`` and counts the
    calls by ``prompt``."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer = answer or self.echo
        self.calls: Counter[str] = Counter()
        self.scopes: list[dict[str, Any]] = []

    @staticmethod
    async def echo(scope: dict[str, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, {"echo": body["prompt"]}

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        body = json.loads(message["body"])
        self.calls[body["prompt"]] += 1
        self.scopes.append(scope)
        status, answer = await self.answer(scope, body)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


async def test_a_line_runs_in_the_batch_lane_and_leaving_disconnects() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope, receive, send) -> None:
        seen.append(await receive())
        seen.append(await receive())  # the "client" leaves
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    leave = trio.Event()
    leave.set()
    answer = await call_app(
        app, ENDPOINT, b"{}", headers={"Authorization": "Bearer k"}, leave=leave
    )
    assert answer.status == 499
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect"]

    recorder = FakeApp()
    await call_app(recorder, ENDPOINT, b'{"prompt": "x"}', headers={"Authorization": "Bearer k"})
    scope = recorder.scopes[0]
    assert scope[LANE_SCOPE_KEY] == BATCH_LANE == "batch"
    assert (b"authorization", b"Bearer k") in scope["headers"]
    assert scope["method"] == "POST" and scope["path"] == ENDPOINT


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(line_runner, "RETRY_MIN", 0.001)
    monkeypatch.setattr(line_runner, "RETRY_MAX", 0.002)
    monkeypatch.setattr(runner_module, "POLL_INTERVAL", 0.05)
    monkeypatch.setattr(runner_module, "STATUS_INTERVAL", 0.02)
    monkeypatch.setattr(runner_module, "RECORD_RETRY", 0.001)


def _request(prompt: str) -> LineRequest:
    return LineRequest(0, "c", ENDPOINT, json.dumps({"prompt": prompt}).encode())


async def test_an_engine_failure_is_run_again_and_never_the_lines_result(quick_retries) -> None:
    engine = FakeEngine()
    statuses = iter([503, 500, 200])

    async def answer(scope, body):
        status = next(statuses)
        if status == 500:  # the engine died under the request, and restarts
            engine.client.error = EngineDeadError("killed")
            engine.client.num_restarts += 1
            engine.client.error = None
        return status, {"status": status}

    app = FakeApp(answer)
    ok, line = await LineRunner(app, engine, {}).run(_request("p"))
    assert ok and app.calls["p"] == 3
    result = json.loads(line)
    assert result["response"]["status_code"] == 200 and result["response"]["body"] == {
        "status": 200
    }
    assert result["custom_id"] == "c" and result["error"] is None


async def test_client_errors_and_repeated_server_errors_are_the_lines_result(quick_retries) -> None:
    async def bad_request(scope, body):
        return 400, {"error": {"message": "no", "param": "prompt"}}

    app = FakeApp(bad_request)
    ok, line = await LineRunner(app, FakeEngine(), {}).run(_request("p"))
    assert not ok and app.calls["p"] == 1
    assert json.loads(line)["response"] == {
        "status_code": 400,
        "request_id": json.loads(line)["response"]["request_id"],
        "body": {"error": {"message": "no", "param": "prompt"}},
    }

    async def broken(scope, body):
        return 500, {"error": {"message": "bug"}}

    app = FakeApp(broken)
    ok, line = await LineRunner(app, FakeEngine(), {}).run(_request("p"))
    assert not ok and app.calls["p"] == line_runner.MAX_SERVER_ERRORS
    assert json.loads(line)["response"]["status_code"] == 500


async def test_an_engine_gone_for_good_ends_the_line_with_its_error(quick_retries) -> None:
    engine = FakeEngine()
    engine.client.error = EngineDeadError("gone")
    engine.ended.set()
    with pytest.raises(EngineDeadError, match="gone"):
        await LineRunner(FakeApp(), engine, {}).run(_request("p"))


async def test_a_line_waits_while_half_the_waiting_line_is_taken(autojump_clock) -> None:
    engine = FakeEngine()
    engine.num_waiting = 2
    app = FakeApp()
    lines = LineRunner(app, engine, {}, max_waiting=5)  # room for 2 waiting requests
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lines.run, _request("p"))
        await trio.sleep(60)  # virtual time: the line looked many times
        assert app.calls["p"] == 0
        engine.num_waiting = 1
    assert app.calls["p"] == 1


# ------------------------------------------------------------------ the runner


def _add_batch(store: Store, lines: list[Any], *, at: int | None = None) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    file_id = stored_files.new_file_id()
    nbytes = stored_files.write_file(store.files_dir, file_id, [text.encode()])
    store.transaction_sync(
        partial(
            stored_files.insert_file,
            file_id=file_id,
            filename="in.jsonl",
            purpose="batch",
            nbytes=nbytes,
            created_at=now(),
            expires_at=None,
        )
    )
    batch = store.transaction_sync(
        partial(
            stored.create_batch,
            input_file_id=file_id,
            endpoint=ENDPOINT,
            completion_window="24h",
            metadata=None,
            at=at,
        )
    )
    return batch["id"]


async def _poll(check: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``check()`` is true (another task's progress in the store), within
    10 s."""
    with trio.fail_after(10):
        while True:
            if await check():
                return
            await trio.sleep(0.01)


async def _until(store: Store, batch_id: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    """The batch, once its status is one of ``statuses``."""
    found: list[dict[str, Any]] = []

    async def reached() -> bool:
        found[:] = [await store.transaction(partial(stored.get_batch, batch_id=batch_id))]
        return found[0]["status"] in statuses

    await _poll(reached)
    return found[0]


def _lines_of(store: Store, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in (store.files_dir / file_id).read_text().splitlines()]


async def _run(store: Store, app: FakeApp, batch_id: str, statuses=stored.FINAL_STATUSES, **kw):
    runner = BatchRunner(app, FakeEngine(), store, max_in_flight=kw.pop("max_in_flight", 3))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        batch = await _until(store, batch_id, statuses)
        nursery.cancel_scope.cancel()
    return batch


async def test_a_batch_runs_every_line_once_and_writes_both_files_in_order(
    store: Store, quick_retries
) -> None:
    async def answer(scope, body):
        await trio.sleep(0.001 * (7 - int(body["prompt"][1:])))  # finish out of order
        if body["prompt"] == "p3":
            return 400, {"error": {"message": "refused"}}
        return 200, {"echo": body["prompt"]}

    lines: list[Any] = [_line(f"c{i}") | {"body": {"prompt": f"p{i}"}} for i in range(7)]
    lines.insert(5, "not json")
    app = FakeApp(answer)
    batch_id = _add_batch(store, lines)
    batch = await _run(store, app, batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 8, "completed": 6, "failed": 2}
    assert app.calls == Counter({f"p{i}": 1 for i in range(7)})
    output = _lines_of(store, batch["output_file_id"])
    assert [line["custom_id"] for line in output] == ["c0", "c1", "c2", "c4", "c5", "c6"]
    assert [line["response"]["body"]["echo"] for line in output] == [
        "p0",
        "p1",
        "p2",
        "p4",
        "p5",
        "p6",
    ]
    errors = _lines_of(store, batch["error_file_id"])
    assert [(e["custom_id"], e["error"] and e["error"]["code"]) for e in errors] == [
        ("c3", None),
        (None, "invalid_json"),
    ]
    assert errors[0]["response"]["status_code"] == 400
    assert all(line["id"].startswith("batch_req_") for line in output + errors)


async def test_a_resumed_batch_runs_only_the_lines_without_a_result(
    store: Store, quick_retries
) -> None:
    batch_id = _add_batch(store, [_line(f"c{i}") | {"body": {"prompt": f"p{i}"}} for i in range(5)])
    store.transaction_sync(partial(stored.start_batch, batch_id=batch_id, total=5))
    for line in (0, 3):  # recorded by a server that was then killed
        result = json.dumps({"custom_id": f"c{line}", "earlier": True})
        store.transaction_sync(
            partial(stored.record_result, batch_id=batch_id, line=line, ok=True, result=result)
        )
    app = FakeApp()
    batch = await _run(store, app, batch_id)
    assert app.calls == Counter({"p1": 1, "p2": 1, "p4": 1})
    output = _lines_of(store, batch["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"c{i}" for i in range(5)]
    assert [line.get("earlier", False) for line in output] == [True, False, False, True, False]


async def test_a_cancelled_batch_aborts_its_lines_and_keeps_what_finished(
    store: Store, quick_retries
) -> None:
    aborted = trio.Event()
    hanging = trio.Event()

    async def answer(scope, body):
        if body["prompt"] != "p0":
            hanging.set()
            try:
                await trio.sleep_forever()
            finally:
                aborted.set()
        return 200, {"echo": body["prompt"]}

    app = FakeApp(answer)
    batch_id = _add_batch(store, [_line(f"c{i}") | {"body": {"prompt": f"p{i}"}} for i in range(6)])
    runner = BatchRunner(app, FakeEngine(), store, max_in_flight=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        await hanging.wait()  # p0 answered, p1 hanging

        async def p0_recorded() -> bool:
            batch = await store.transaction(partial(stored.get_batch, batch_id=batch_id))
            return batch["request_counts"]["completed"] == 1

        await _poll(p0_recorded)
        await store.transaction(partial(stored.request_cancel, batch_id=batch_id))
        runner.wake()
        batch = await _until(store, batch_id, ("cancelled",))
        nursery.cancel_scope.cancel()
    assert aborted.is_set()
    assert batch["request_counts"] == {"total": 6, "completed": 1, "failed": 0}
    assert [line["custom_id"] for line in _lines_of(store, batch["output_file_id"])] == ["c0"]
    assert batch["error_file_id"] is None and batch["cancelled_at"] is not None


async def test_an_expired_batch_lists_the_lines_it_did_not_run(store: Store, quick_retries) -> None:
    batch_id = _add_batch(store, [_line("a"), _line("b")], at=now() - 2 * 86400)
    app = FakeApp()
    batch = await _run(store, app, batch_id)
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert sum(app.calls.values()) == 0
    errors = _lines_of(store, batch["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("a", "batch_expired"),
        ("b", "batch_expired"),
    ]
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


async def test_duplicate_custom_ids_fail_the_batch_at_validation(
    store: Store, quick_retries
) -> None:
    batch_id = _add_batch(store, [_line("a"), _line("b"), _line("a")])
    app = FakeApp()
    batch = await _run(store, app, batch_id)
    assert batch["status"] == "failed" and sum(app.calls.values()) == 0
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("duplicate_custom_id", 3)]


async def test_a_busy_store_is_retried_and_a_broken_line_fails_alone(
    store: Store, quick_retries, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_record = stored.record_result
    refusals = iter([True, True, False])

    def flaky_record(tx, **kw):
        if kw["line"] == 1 and next(refusals, False):
            raise StoreUnavailable("the store is busy: database is locked")
        return real_record(tx, **kw)

    monkeypatch.setattr(stored, "record_result", flaky_record)

    async def answer(scope, body):
        if body["prompt"] == "boom":
            raise RuntimeError("a bug in a route")
        return 200, {"echo": body["prompt"]}

    app = FakeApp(answer)
    broken = _add_batch(store, [_line("x") | {"body": {"prompt": "boom"}}])
    good = _add_batch(store, [_line(f"c{i}") | {"body": {"prompt": f"p{i}"}} for i in range(3)])
    runner = BatchRunner(app, FakeEngine(), store, max_in_flight=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        failed = await _until(store, broken, stored.FINAL_STATUSES)
        done = await _until(store, good, stored.FINAL_STATUSES)
        nursery.cancel_scope.cancel()
    assert failed["status"] == "completed" and failed["errors"] is None
    assert failed["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    (error,) = _lines_of(store, failed["error_file_id"])
    assert (error["custom_id"], error["error"]["code"]) == ("x", "internal_error")
    assert "a bug in a route" not in error["error"]["message"]  # no internals
    assert done["status"] == "completed"
    assert [line["custom_id"] for line in _lines_of(store, done["output_file_id"])] == [
        "c0",
        "c1",
        "c2",
    ]


def _five_good_and(poisoned: dict[str, Any]) -> list[dict[str, Any]]:
    lines = [_line(f"c{i}") | {"body": {"prompt": f"p{i}"}} for i in range(5)]
    lines.insert(2, poisoned)
    return lines


async def test_a_lone_surrogate_in_a_custom_id_is_kept_as_its_escape(
    store: Store, quick_retries
) -> None:
    # Valid JSON: the custom_id is echoed into the result line, which is stored and
    # written to the output file as UTF-8 text.
    poisoned = _line("bad\ud800id") | {"body": {"prompt": "poison"}}
    batch_id = _add_batch(store, _five_good_and(poisoned))
    batch = await _run(store, FakeApp(), batch_id)
    assert batch["status"] == "completed" and batch["errors"] is None
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    text = (store.files_dir / batch["output_file_id"]).read_bytes().decode("utf-8")
    assert "bad\\ud800id" in text  # the escape it came as
    ids = [line["custom_id"] for line in _lines_of(store, batch["output_file_id"])]
    assert ids == ["c0", "c1", "bad\ud800id", "c2", "c3", "c4"]


async def test_an_unexpected_error_in_one_line_fails_that_line_not_the_batch(
    store: Store, quick_retries, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_record = stored.record_result

    def record(tx, **kw):
        if '"poison"' in kw["result"]:  # the first record of the poisoned line
            "bad\ud800id".encode()  # what a driver's bind raised on main
        return real_record(tx, **kw)

    monkeypatch.setattr(stored, "record_result", record)

    async def answer(scope, body):
        if body["prompt"] == "boom":
            raise KeyError("/srv/secret/path")
        return 200, {"echo": body["prompt"]}

    lines = _five_good_and(_line("poisoned") | {"body": {"prompt": "poison"}})
    lines.append(_line("boom") | {"body": {"prompt": "boom"}})
    batch_id = _add_batch(store, lines)
    batch = await _run(store, FakeApp(answer), batch_id)
    assert batch["status"] == "completed" and batch["errors"] is None
    assert batch["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    output = _lines_of(store, batch["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"c{i}" for i in range(5)]
    errors = _lines_of(store, batch["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"], e["response"]) for e in errors] == [
        ("poisoned", "internal_error", None),
        ("boom", "internal_error", None),
    ]
    assert not any("secret" in e["error"]["message"] for e in errors)


async def test_a_full_disk_while_finalizing_is_tried_again(
    store: Store, quick_retries, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = stored.write_result_files
    full = [True]

    def write_once_full(*args):
        if full.pop() if full else False:
            raise OSError(28, "No space left on device")
        return real_write(*args)

    monkeypatch.setattr(stored, "write_result_files", write_once_full)
    batch_id = _add_batch(store, [_line("a"), _line("b")])
    app = FakeApp()
    batch = await _run(store, app, batch_id)
    assert batch["status"] == "completed" and full == []
    assert [line["custom_id"] for line in _lines_of(store, batch["output_file_id"])] == ["a", "b"]
    assert sum(app.calls.values()) == 2


async def test_a_batch_cancelled_before_it_ran_ends_cancelled_with_no_files(
    store: Store, quick_retries
) -> None:
    batch_id = _add_batch(store, [_line("a")])
    store.transaction_sync(partial(stored.request_cancel, batch_id=batch_id))
    app = FakeApp()
    batch = await _run(store, app, batch_id)
    assert batch["status"] == "cancelled" and sum(app.calls.values()) == 0
    assert (batch["output_file_id"], batch["error_file_id"]) == (None, None)
