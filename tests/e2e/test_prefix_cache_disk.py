"""The prefix cache's tier on disk through real servers (issue 44): a restarted server,
the other engine of ``-dp 2`` and a model unloaded and loaded again read a long prompt's
blocks back, say so in ``cached_tokens``, and answer exactly as the first engine did
(float32, greedy); a request of another ``cache_salt`` finds none. An engine and a server
SIGKILLed while blocks are written leave no half block visible, and block files damaged
on disk are refused and computed again, never answered from.

The two-server and the kill tests are the opt-in chaos tier (replicas and kills, over a
minute together): ``TRIO_LLM_CHAOS_TRIALS=1 HF_HUB_OFFLINE=1 .venv/bin/pytest
tests/e2e/test_prefix_cache_disk.py``. The damaged-file checks also run in-process in
tests/unit/engine/test_prefix_tier.py and test_kv_files.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.procfs import descendants, engine_children, is_running
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess
from trio_llm.engine import kv_files
from trio_llm.engine.block_manager import prefix_keys
from trio_llm.messages import SamplingParams

#: About 800 tokens of a prompt (50 full blocks), within the small server's 1,024.
PROMPT = " ".join(f"Item {i} is the number {i * 7 % 101}." for i in range(90))


def _serve(folder: Path, name: str, *flags: str) -> ServerProcess:
    server = ServerProcess(
        [
            *SMALL_SERVER_ARGS,
            "--dtype",
            "float32",
            "--prefix-cache-dir",
            str(folder / "kv"),
            *flags,
        ],
        log_path=folder / f"{name}.log",
    )
    server.start()
    return server


#: Another prompt of about 800 tokens, sharing no block with `PROMPT`.
OTHER_PROMPT = " ".join(f"Box {i} holds {i * 13 % 97} red stones." for i in range(90))


def _complete(
    url: str, rank: int | None = None, prompt: str = PROMPT, **extra: Any
) -> tuple[str, int, int]:
    """``prompt``'s greedy completion (on engine ``rank`` of ``-dp N``): its text, prompt
    tokens and cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    usage = reply["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return reply["choices"][0]["text"], usage["prompt_tokens"], cached


def _disk_metrics(url: str, engine: int = 0) -> dict[str, float]:
    """The ``trio_llm:prefix_cache_disk_*_total`` counters of ``/metrics`` of engine
    ``engine``, by name."""
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("trio_llm:prefix_cache_disk_") and f'engine="{engine}"' in line:
            name = line.split("{")[0].removeprefix("trio_llm:prefix_cache_disk_")
            found[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
    return found


def _wait_for_files(folder: Path, count: int) -> None:
    """Until the writer has put ``count`` block files in ``folder`` (its own pace)."""
    deadline = time.monotonic() + 60
    while len(list(folder.rglob("*.kv"))) < count:
        assert time.monotonic() < deadline, "the blocks were not written"
        time.sleep(0.05)


#: The opt-in chaos tier's switch (tests/chaos/test_chaos.py reads the same variable).
OPT_IN = pytest.mark.skipif(
    not os.environ.get("TRIO_LLM_CHAOS_TRIALS"),
    reason="opt-in chaos test: set TRIO_LLM_CHAOS_TRIALS=1",
)


@pytest.mark.chaos
@OPT_IN
def test_two_servers_on_one_folder_share_what_either_computed(tmp_path: Path) -> None:
    """Two servers of one model running at once (as `-dp 2`'s engines, or two servers on
    one machine): what the first computed, the second reads from disk."""
    first, second = _serve(tmp_path, "first"), None
    try:
        second = _serve(tmp_path, "second")
        cold, num_prompt, _ = _complete(first.url)
        wanted = (num_prompt - 1) // 16
        _wait_for_files(tmp_path / "kv", wanted)
        warm, _, warm_cached = _complete(second.url)
        assert warm == cold
        assert warm_cached == wanted * 16
        assert _disk_metrics(second.url)["hits"] == wanted
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.long
def test_the_other_engine_a_reloaded_model_and_a_restarted_server_read_the_blocks(
    tmp_path: Path,
) -> None:
    """``-dp 2``: engine 0 computes the prompt; engine 1 (the request names it, as with
    vLLM's ``X-data-parallel-rank``) reads it from disk. The model is unloaded
    (``POST /models/unload``) and the next request's new engine reads it from disk; so
    does a new server after this one stopped. Every answer is the first one's; a request
    of another ``cache_salt`` finds nothing."""
    first = _serve(tmp_path, "dp", "--data-parallel-size", "2", "--keep-alive", "forever")
    try:
        cold, num_prompt, cold_cached = _complete(first.url, rank=0)
        wanted = (num_prompt - 1) // 16
        assert cold_cached == 0 and num_prompt > 600
        _wait_for_files(tmp_path / "kv", wanted)
        other, _, other_cached = _complete(first.url, rank=1)
        assert (other, other_cached) == (cold, wanted * 16)
        assert _disk_metrics(first.url, engine=1)["hits"] == wanted
        [model] = [card["id"] for card in httpx.get(f"{first.url}/v1/models").json()["data"]]
        unload = httpx.post(f"{first.url}/models/unload", json={"model": model}, timeout=120)
        assert unload.json() == {"success": True}
        reloaded, _, reloaded_cached = _complete(first.url, rank=0)
        assert (reloaded, reloaded_cached) == (cold, wanted * 16)
        assert _disk_metrics(first.url, engine=0)["hits"] == wanted
        assert first.stop() == 0  # the writers finish before the engines exit
    finally:
        first.close()

    second = _serve(tmp_path, "restarted")
    try:
        warm, _, warm_cached = _complete(second.url)
        assert (warm, warm_cached) == (cold, wanted * 16)
        disk = _disk_metrics(second.url)
        assert disk["hits"] == wanted and disk["refused"] == 0 and disk["bytes_read"] > 0
        salted, _, salted_cached = _complete(second.url, cache_salt="another tenant")
        assert (salted, salted_cached) == (cold, 0)
        assert "prefix cache on disk:" in second.log()
        assert second.stop() == 0
    finally:
        second.close()


def _block_files(folder: Path, url: str, prompt: str, salt: str | None = None) -> list[Path]:
    """The files of ``prompt``'s full blocks (salted with ``salt``) in ``folder``, in order
    (``url``'s server tokenizes the prompt)."""
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    (space,) = [p for p in folder.iterdir() if p.name != "digests"]
    return [
        space / f"{key.hex()}.g0.kv"
        for key in prefix_keys(tokens, 16, SamplingParams(cache_salt=salt))
    ]


def _wait_for_paths(paths: list[Path]) -> None:
    """Until every one of ``paths`` exists (the writer's pace)."""
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, "the blocks were not written"
        time.sleep(0.05)


def _wait_until_serving(url: str) -> None:
    """Until ``/health`` answers 200 (a restarted engine serves again)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.1)


def _assert_every_file_whole(folder: Path) -> int:
    """Every block file in ``folder`` is a whole block (header, length, sha256); returns
    how many there are."""
    files = list(folder.rglob("*.kv"))
    for path in files:
        header = kv_files._header(path.read_bytes())
        shapes = [tuple(shape) for shape in header["shapes"]]
        key = bytes.fromhex(path.name.split(".")[0])
        kv_files.decode(path.read_bytes(), path.parent.name, 0, key, torch.float32, shapes)
    return len(files)


def _kill_when_written(server: ServerProcess, folder: Path, victim: int, prompt: str) -> None:
    """Send ``prompt`` and SIGKILL process ``victim`` as soon as a new block file of the
    request shows (the writer is then at work on the rest of its blocks)."""
    before = len(list(folder.rglob("*.kv")))
    request = threading.Thread(target=_complete_quietly, args=(server.url, prompt), daemon=True)
    request.start()
    deadline = time.monotonic() + 120
    while len(list(folder.rglob("*.kv"))) <= before:
        assert time.monotonic() < deadline, "no block was written"
        time.sleep(0.001)
    os.kill(victim, signal.SIGKILL)
    request.join(120)


def _complete_quietly(url: str, prompt: str) -> None:
    """A request whose server is killed under it (its failure is the test's point)."""
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
    except httpx.HTTPError:
        pass


@pytest.mark.chaos
@OPT_IN
def test_kills_mid_write_and_damaged_files_never_change_an_answer(tmp_path: Path) -> None:
    """SIGKILL of the engine, then of the whole server, while blocks are written: no half
    block is ever visible and the next server clears what the dead writers left. Block
    files damaged on disk (a flipped byte, a link to another block's file, a truncation)
    are refused, counted, removed and computed again: every answer is the cold one."""
    kv = tmp_path / "kv"
    first = _serve(tmp_path, "killed", "--engine-restart", "on-failure")
    try:
        (engine,) = engine_children(first.pid)
        _kill_when_written(first, kv, engine, PROMPT)
        _wait_until_serving(first.url)  # the supervisor restarted the engine
        for salt in (None, "tenant"):  # two whole chains on disk
            _complete(first.url, cache_salt=salt)
        plain = _block_files(kv, first.url, PROMPT)
        salted = _block_files(kv, first.url, PROMPT, "tenant")
        other = _block_files(kv, first.url, OTHER_PROMPT)
        _wait_for_paths(plain + salted)
        flipped, linked, target = plain[3], salted[0], salted[1]
        tree = descendants(first.pid) | {first.pid}
        _kill_when_written(first, kv, first.pid, OTHER_PROMPT)
        first.wait(60)
        deadline = time.monotonic() + 60
        while any(is_running(pid) for pid in tree - {first.pid}):  # a zombie is dead
            assert time.monotonic() < deadline, "the engine outlived its killed server"
            time.sleep(0.05)
    finally:
        first.close()
    assert _assert_every_file_whole(kv) > 0
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(data)
    linked.unlink()
    linked.symlink_to(target)
    # The first of the other prompt's blocks the killed server wrote loses its tail.
    cut = next(path for path in other if path.exists())
    os.truncate(cut, cut.stat().st_size // 2)

    second = _serve(tmp_path, "after")
    try:
        assert not list(kv.rglob("*.tmp")), "a dead writer's temporary file was left"
        refused = 0
        for prompt, salt, damaged in (
            (PROMPT, None, flipped),
            (PROMPT, "tenant", linked),
            (OTHER_PROMPT, None, cut),
        ):
            cold, _, _ = _complete(second.url, prompt=prompt, cache_salt=f"cold {salt}")
            warm, num_prompt, cached = _complete(second.url, prompt=prompt, cache_salt=salt)
            assert warm == cold
            refused += 1
            assert _disk_metrics(second.url)["refused"] == refused
            assert not damaged.is_symlink()  # removed, then written again whole
            assert cached < num_prompt
        assert second.stop() == 0
    finally:
        second.close()
    assert _assert_every_file_whole(kv) > 0
