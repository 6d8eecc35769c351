"""The prefix cache's tier on disk through real servers (issue 44): a restarted server
reads a long prompt's blocks back, says so in ``cached_tokens``, and answers exactly as
the first one did (float32, greedy); a request of another ``cache_salt`` finds none."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess

#: About 800 tokens of a prompt (50 full blocks), within the small server's 1,024.
PROMPT = " ".join(f"Item {i} is the number {i * 7 % 101}." for i in range(90))


def _serve(folder: Path, name: str) -> ServerProcess:
    server = ServerProcess(
        [*SMALL_SERVER_ARGS, "--dtype", "float32", "--prefix-cache-dir", str(folder / "kv")],
        log_path=folder / f"{name}.log",
    )
    server.start()
    return server


def _complete(url: str, **extra: Any) -> tuple[str, int, int]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    usage = reply["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return reply["choices"][0]["text"], usage["prompt_tokens"], cached


def _disk_metrics(url: str) -> dict[str, float]:
    """The ``trio_llm:prefix_cache_disk_*_total`` counters of ``/metrics``, by name."""
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("trio_llm:prefix_cache_disk_"):
            name = line.split("{")[0].removeprefix("trio_llm:prefix_cache_disk_")
            found[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_restarted_server_reads_the_prompt_from_disk_and_answers_the_same(
    tmp_path: Path,
) -> None:
    first = _serve(tmp_path, "first")
    try:
        cold, num_prompt, cold_cached = _complete(first.url)
        assert cold_cached == 0 and num_prompt > 600
        assert first.stop() == 0  # the writer finishes before the engine exits
    finally:
        first.close()
    files = list((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= (num_prompt - 1) // 16

    second = _serve(tmp_path, "second")
    try:
        warm, _, warm_cached = _complete(second.url)
        assert warm == cold
        assert warm_cached == (num_prompt - 1) // 16 * 16
        disk = _disk_metrics(second.url)
        assert disk["hits"] == warm_cached // 16 and disk["refused"] == 0
        assert disk["bytes_read"] > 0
        salted, _, salted_cached = _complete(second.url, cache_salt="another tenant")
        assert (salted, salted_cached) == (cold, 0)
        assert "prefix cache on disk:" in second.log()
        assert second.stop() == 0
    finally:
        second.close()


def test_two_servers_on_one_folder_share_what_either_computed(tmp_path: Path) -> None:
    """Two servers of one model running at once (as `-dp 2`'s engines, or two servers on
    one machine): what the first computed, the second reads from disk."""
    first, second = _serve(tmp_path, "first"), None
    try:
        second = _serve(tmp_path, "second")
        cold, num_prompt, _ = _complete(first.url)
        wanted = (num_prompt - 1) // 16
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "kv").rglob("*.kv"))) < wanted:  # the writer's pace
            assert time.monotonic() < deadline, "the first server's blocks were not written"
            time.sleep(0.05)
        warm, _, warm_cached = _complete(second.url)
        assert warm == cold
        assert warm_cached == wanted * 16
        assert _disk_metrics(second.url)["hits"] == wanted
    finally:
        first.close()
        if second is not None:
            second.close()
