"""``trio-llm run-batch -i IN -o OUT``: run a file of batch requests offline, as vLLM's
``run-batch`` does.

The engine and the HTTP app start in this process, as ``trio-llm serve`` would start
them (the same flags), but no port is bound: each line of IN runs through the app in
process (`trio_llm.api.batch.line_runner.LineRunner`, the batch runner's own path), so its
result is what the same request sent to a server would get. OUT gets one line per input
line, in input order, in the batch output-file format, failures included (their
``response`` has the 4xx status and error body, or ``error`` says why the line could not
run). Lines may go to any endpoint a batch may (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from trio_llm.api.app import build_app
from trio_llm.api.batch.line_runner import LineRunner, api_key_headers, run_line
from trio_llm.api.batch.lines import InputLines, check_input, parse_line
from trio_llm.api.model_router import RouterEngines
from trio_llm.server.model_catalog import catalog_of
from trio_llm.server.model_pool import ModelPool
from trio_llm.server.supervisor import Lifecycle, open_server_store
from trio_llm.server_config import ServerConfig
from trio_llm.store.batches import ENDPOINTS

logger = logging.getLogger(__name__)


class RunBatchError(Exception):
    """IN or OUT cannot be used (a URL, a missing file, duplicate ``custom_id``s): the
    message says why."""


@dataclass
class Summary:
    """What a run did: lines in all, and how many succeeded (2xx) or failed."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0


def check_paths(input_file: str, output_file: str) -> tuple[Path, Path]:
    """IN and OUT as local paths.

    Raises:
        RunBatchError: a URL (vLLM also takes URLs; this command reads and writes local
            files only), a missing input file, or an output folder that does not exist.
    """
    for name, value in (("-i/--input-file", input_file), ("-o/--output-file", output_file)):
        if "://" in value:
            raise RunBatchError(
                f"{name} {value!r} is a URL; trio-llm run-batch reads and writes local files "
                "only (download the input first)"
            )
    source, target = Path(input_file), Path(output_file)
    if not source.is_file():
        raise RunBatchError(f"-i/--input-file {input_file!r}: no such file")
    if not target.parent.is_dir():
        raise RunBatchError(f"-o/--output-file {output_file!r}: its folder does not exist")
    return source, target


class _OrderedWriter:
    """Writes results to a file in input order as they arrive in any order."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.pending: dict[int, str] = {}
        self.next = 0
        self.lock = trio.Lock()

    async def put(self, index: int, line: str) -> None:
        self.pending[index] = line
        async with self.lock:
            while self.next in self.pending:
                await self.handle.write(self.pending.pop(self.next) + "\n")
                self.next += 1


async def _run_lines(lines: LineRunner, source: Path, target: Path, max_in_flight: int) -> Summary:
    """Run every line of ``source``, writing ``target`` (through a temporary name)."""
    summary = Summary()
    slots = trio.Semaphore(max_in_flight)
    partial_target = target.with_name(f".{target.name}.partial")
    async with await trio.open_file(partial_target, "w", encoding="utf-8") as handle:
        writer = _OrderedWriter(handle)

        async def one(index: int, raw: bytes) -> None:
            try:
                ok, result = await run_line(lines, parse_line(index, raw, ENDPOINTS))
                summary.succeeded += ok
                summary.failed += not ok
                await writer.put(index, result)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery, InputLines(source) as reader:
            while chunk := await reader.next_chunk():
                for index, raw in chunk:
                    summary.total += 1
                    await slots.acquire()
                    nursery.start_soon(one, index, raw)
    await trio.Path(partial_target).replace(target)
    return summary


async def run_batch(config: ServerConfig, source: Path, target: Path) -> Summary:
    """Start the engine(s) and the app, run every line of ``source`` into ``target``,
    stop.

    Raises:
        RunBatchError: ``source`` is unusable as a whole (duplicate ``custom_id``s, no
            line, too many lines).
        EngineDeadError: (inside an ExceptionGroup) the engine failed for good.
    """
    _, errors = await trio.to_thread.run_sync(check_input, source)
    if errors:
        listed = "; ".join(error["message"] for error in errors[:5])
        raise RunBatchError(f"{source}: {listed}")
    store = await open_server_store(config)
    try:
        async with trio.open_nursery() as nursery:
            # The server's models (each line's ``model`` chooses; the default model
            # loaded first), with no port.
            pool = ModelPool(config, catalog_of(config), Lifecycle())
            pool.store = store
            await nursery.start(pool.run)
            app = build_app(pool, lambda: True, config)
            headers = api_key_headers(config.api_key)
            lines = LineRunner(app, RouterEngines(pool), headers, config.max_num_waiting_requests)
            limit = config.store.batch_max_in_flight or config.engine_slots()
            summary = await _run_lines(lines, source, target, limit)
            await pool.stop(config.shutdown_timeout)
    finally:
        if store is not None:
            store.close()
    return summary
