"""Hostile uploads against a real server (issue 41, items 6, 7, 8, 12 and 13).

A server with small upload limits (`FLAGS`) takes: a chunked upload past
``--max-file-size`` from a client that keeps sending, 100,000 form fields, uploads that
drip one byte at a time, a boundary the multipart parser cannot take, and an upload after
the store's ``files/`` folder was removed. Each is answered at once, with its connection
closed and its temporary file gone, and the server afterwards is the same process,
answering normally. Speed is not asserted (bench/upload_abuse.py measures it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.metrics_scrape import poll
from tests.support.procfs import count_fds
from tests.support.server_process import ServerProcess
from tests.support.uploads import (
    chunked,
    connect,
    part_head,
    read_to_the_end,
    send_chunks,
    upload_head,
)

#: --max-file-size, --request-body-timeout (s) and --upload-min-rate (bytes/s).
MAX_FILE = 64 * 1024
BODY_TIMEOUT = 2.0
MIN_RATE = 1024
FLAGS = [
    *("--max-num-seqs", "4", "--kv-cache-memory", "64MiB"),
    *("--dtype", "float32", "--max-file-size", f"{MAX_FILE // 1024}KiB"),
    *("--request-body-timeout", f"{BODY_TIMEOUT:g}", "--upload-min-rate", str(MIN_RATE)),
]
#: A guard against a client waiting for ever (not a measurement).
HANG = 30.0


@pytest.fixture(scope="module")
def upload_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServerProcess]:
    """A server of the tiny model with a store and the small upload limits of `FLAGS`."""
    folder = tmp_path_factory.mktemp("upload-server")
    flags = ["--model", str(tiny_model_dir), "--store-url", f"sqlite:///{folder / 'store.db'}"]
    process = ServerProcess([*flags, *FLAGS], log_path=folder / "server.log")
    with process:
        yield process
    assert process.process is not None
    assert process.process.returncode == 0, process.log()


def files_dir(server: ServerProcess) -> Path:
    return server.log_path.parent / "files"


@pytest.fixture
def same_server(upload_server: ServerProcess) -> Iterator[ServerProcess]:
    """The shared server; afterwards the same process, with no temporary file left and
    an upload that works."""
    pid = upload_server.pid
    yield upload_server
    assert upload_server.process is not None and upload_server.process.poll() is None
    assert upload_server.pid == pid
    assert not list(files_dir(upload_server).glob("*.partial")), upload_server.log()
    answer = httpx.post(
        f"{upload_server.url}/v1/files",
        files={"file": ("ok.jsonl", b"{}\n")},
        data={"purpose": "batch"},
        timeout=HANG,
    )
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{upload_server.url}/health", timeout=HANG).status_code == 200


async def answer_while_sending(server: ServerProcess, chunks: Iterable[bytes]) -> bytes:
    """Send an upload's head, then ``chunks`` without waiting for the answer; the answer
    once the server ended the connection (the sending ends when its socket refuses)."""
    stream = await connect(server.url)
    with trio.fail_after(HANG):
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(upload_head())
            nursery.start_soon(send_chunks, stream, chunks)
            return await read_to_the_end(stream)


async def test_a_file_past_its_limit_is_answered_and_its_connection_ended_mid_send(
    same_server: ServerProcess,
) -> None:
    """Item 8: the client that keeps sending sees the 413 and the end of the connection
    (it used to block until its own timeout)."""
    endless = (b"x" * 65536 for _ in range(100_000))  # 6 GiB, were it all sent
    answer = await answer_while_sending(same_server, chain([part_head("file", "a")], endless))
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b"file_too_large" in answer


async def test_many_form_fields_are_refused_at_the_first(same_server: ServerProcess) -> None:
    """Item 6: the issue's 100,000 fields (474 MiB) are refused at the first, at once."""
    field = part_head("x" * 4000) + b"v" * 700 + b"\r\n"
    answer = await answer_while_sending(same_server, (field * 10 for _ in range(10_000)))
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b'"param":"' + b"x" * 100 + b'"' in answer


async def drip(server: ServerProcess, answers: list[bytes]) -> None:
    """An upload that sends its file one byte every `BODY_TIMEOUT` / 4 seconds (never
    stalling as long as --request-body-timeout); its answer goes to ``answers``."""
    stream = await connect(server.url)
    async with stream, trio.open_nursery() as nursery:
        await stream.send_all(upload_head() + chunked(part_head("file", "slow")))
        nursery.start_soon(_one_byte_at_a_time, stream)
        answers.append(await read_to_the_end(stream))
        nursery.cancel_scope.cancel()


async def _one_byte_at_a_time(stream: trio.SocketStream) -> None:
    try:
        for _ in range(1000):
            await trio.sleep(BODY_TIMEOUT / 4)  # the client's pace, not a synchronisation
            await stream.send_all(chunked(b"x"))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def test_slow_drip_uploads_get_408_and_free_their_files(same_server: ServerProcess) -> None:
    """Item 7: uploads that drip (each byte within --request-body-timeout of the last)
    are cut by the whole body's deadline, their temporary files removed, their
    descriptors closed."""
    pid = same_server.pid
    assert pid is not None
    before = count_fds(pid)
    answers: list[bytes] = []
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(drip, same_server, answers)
    assert len(answers) == 20
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers), answers
    assert not list(files_dir(same_server).glob("*.partial"))

    async def descriptors_back() -> bool:
        return count_fds(pid) <= before

    await poll(descriptors_back, seconds=HANG)


async def test_a_boundary_too_long_for_the_parser_is_a_400(same_server: ServerProcess) -> None:
    """Item 13: it was a 500 (FormParserError)."""
    boundary = "b" * 300
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    async with httpx.AsyncClient(base_url=same_server.url, timeout=HANG) as client:
        answer = await client.post(
            "/v1/files",
            content=body + f"--{boundary}--\r\n",
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"


async def test_an_upload_after_the_files_folder_vanished_is_stored(
    same_server: ServerProcess,
) -> None:
    """Item 12: it was a 500 naming the temporary file's path, with a traceback."""
    shutil.rmtree(files_dir(same_server))
    async with httpx.AsyncClient(base_url=same_server.url, timeout=HANG) as client:
        answer = await client.post(
            "/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}
        )
        assert answer.status_code == 200, answer.text
        content = await client.get(f"/v1/files/{answer.json()['id']}/content")
    assert content.content == b"{}\n"
    assert str(files_dir(same_server)) not in answer.text
