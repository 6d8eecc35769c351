"""Abusive uploads (issue 41, items 6 and 7): the API server's memory under a flood of form
fields, and what slow-drip uploads hold.

    python bench/upload_abuse.py [--fields 100000] [--drips 200] [--drip-seconds 40] \\
        [--drip-interval 3] [--request-body-timeout 6] [--model M] [--pythonpath DIR] \\
        [--json out.json] [-- more serve flags]

Starts ``trio-llm serve`` with a store of its own (``--request-body-timeout`` as given;
every other upload limit at its default), then:

(a) fields: one chunked ``POST /v1/files`` of ``--fields`` form fields of about 5 KB each
    (a 4,000-byte name and a 900-byte value: 100,000 of them are the issue's 474 MiB),
    sent without waiting for the answer. Prints the server's RSS (``VmRSS`` of the API
    server process) before and after, its peak (``VmHWM``), the answer's status, how many
    bytes the client got to send, and how long until the answer.
(b) drips: ``--drips`` uploads at once, each sending its file one byte every
    ``--drip-interval`` seconds. After ``--drip-seconds`` prints how many are still open
    (no answer, no end of connection), their answers so far, the ``.partial`` files in the
    store's folder and the server's file descriptors (``/proc/PID/fd``), before and after.

Run it against this checkout and against another (``--pythonpath /work/main``) for the
figures before and after, from a folder that is not a checkout (``cd /tmp``): the server
runs ``python -m trio_llm``, which finds the package in the current folder before
``PYTHONPATH``. A run takes about a minute plus the model's start-up.

Measured on 2 shared cores (SmolLM2, ``--request-body-timeout 6``, 2026-12-05):
main: (a) 400 after all 472.7 MiB were sent (13.2 s), RSS 99 -> 567 MiB; (b) after 40 s
200 of 200 uploads open, 200 ``.partial`` files, 414 fds (14 before). This branch: (a)
400 at once (0.9 MiB in flight), RSS 99 -> 100 MiB (peak 107); (b) 0 open, 200 answered
408, no ``.partial`` file, 14 fds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import trio
from common import parse_server_args, print_table, server_env, write_json

from tests.support.procfs import count_fds
from tests.support.server_process import ServerProcess
from tests.support.uploads import (
    BOUNDARY,
    chunked,
    connect,
    part_head,
    read_to_the_end,
    upload_head,
)
from trio_llm.config import DEFAULT_MODEL


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` (KiB)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


def count_partial_files(files_dir: Path) -> int:
    return len(list(files_dir.glob("*.partial")))


def status_of(answer: bytes) -> str:
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"


async def many_fields(url: str, pid: int, num_fields: int) -> dict[str, Any]:
    """(a): the flood of form fields, and the server's memory around it."""
    before = memory_kib(pid)
    stream = await connect(url)
    sent = 0
    answer = b""
    started = time.monotonic()
    answered_at = float("nan")

    async def send() -> None:
        nonlocal sent
        try:
            for start in range(0, num_fields, 100):
                batch = b"".join(
                    part_head(f"f{i}".ljust(4000, "x")) + b"v" * 900 + b"\r\n"
                    for i in range(start, min(start + 100, num_fields))
                )
                await stream.send_all(chunked(batch))
                sent += len(batch)
            await stream.send_all(chunked(f"--{BOUNDARY}--\r\n".encode()) + b"0\r\n\r\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with stream, trio.open_nursery() as nursery:
        await stream.send_all(upload_head())
        nursery.start_soon(send)
        answer = await read_to_the_end(stream)
        answered_at = time.monotonic() - started
    after = memory_kib(pid)
    return {
        "fields": num_fields,
        "status": status_of(answer),
        "MiB sent": round(sent / 2**20, 1),
        "answer after s": round(answered_at, 2),
        "RSS before MiB": round(before["VmRSS"] / 1024),
        "RSS after MiB": round(after["VmRSS"] / 1024),
        "peak RSS MiB": round(after["VmHWM"] / 1024),
    }


async def drips(
    url: str, pid: int, files_dir: Path, num: int, interval: float, seconds: float
) -> dict[str, Any]:
    """(b): ``num`` slow-drip uploads, looked at after ``seconds``."""
    fds_before = count_fds(pid)
    answers: dict[int, bytes] = {}

    async def drip(index: int) -> None:
        stream = await connect(url)
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(upload_head() + chunked(part_head("file", "slow.jsonl")))

            async def one_byte_at_a_time() -> None:
                try:
                    while True:
                        await trio.sleep(interval)
                        await stream.send_all(chunked(b"x"))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(one_byte_at_a_time)
            answers[index] = await read_to_the_end(stream)
            nursery.cancel_scope.cancel()

    seen: dict[str, Any] = {}

    async def look_after_the_wait(cancel_scope: trio.CancelScope) -> None:
        await trio.sleep(seconds)
        seen["still open"] = num - len(answers)  # no answer and no end of connection
        seen[".partial files"] = await trio.to_thread.run_sync(count_partial_files, files_dir)
        seen["server fds"] = count_fds(pid)
        cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for index in range(num):
            nursery.start_soon(drip, index)
        nursery.start_soon(look_after_the_wait, nursery.cancel_scope)
    statuses = Counter(status_of(answer) for answer in answers.values())
    return {
        "uploads": num,
        "after s": seconds,
        **seen,
        "server fds before": fds_before,
        "answers": dict(statuses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fields", type=int, default=100_000)
    parser.add_argument("--drips", type=int, default=200)
    parser.add_argument("--drip-seconds", type=float, default=40.0)
    parser.add_argument("--drip-interval", type=float, default=3.0)
    parser.add_argument("--request-body-timeout", type=float, default=6.0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parse_server_args(parser)
    with tempfile.TemporaryDirectory(prefix="upload-abuse-") as scratch:
        folder = Path(scratch)
        flags = ["--model", args.model, "--store-url", f"sqlite:///{folder / 'store.db'}"]
        flags += ["--request-body-timeout", f"{args.request_body_timeout:g}"]
        flags += ["--dtype", "float32", "--max-num-seqs", "4", *args.server_flags]
        server = ServerProcess(flags, log_path=folder / "server.log", env=server_env(args))
        with server:
            fields = trio.run(many_fields, server.url, server.pid, args.fields)
            print("(a) form fields")
            print_table([fields], list(fields))
            held = trio.run(
                drips,
                server.url,
                server.pid,
                folder / "files",
                args.drips,
                args.drip_interval,
                args.drip_seconds,
            )
            print("(b) slow-drip uploads")
            print_table([held], list(held))
        print(f"server ({args.pythonpath or 'this checkout'}) exited {server.process.returncode}")
    write_json(args.json, {"fields": fields, "drips": held, "pythonpath": args.pythonpath})


if __name__ == "__main__":
    main()
