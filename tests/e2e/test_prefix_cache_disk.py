"""The prefix cache's tier on disk through real servers (issue 44): a restarted server,
the other engine of ``-dp 2`` and a model unloaded and loaded again read a long prompt's
blocks back, say so in ``cached_tokens``, and answer exactly as the first engine did
(float32, greedy); a request of another ``cache_salt`` finds none."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess

#: About 800 tokens of a prompt (50 full blocks), within the small server's 1,024.
PROMPT = " ".join(f"Item {i} is the number {i * 7 % 101}." for i in range(90))


def _serve(folder: Path, name: str, *flags: str) -> ServerProcess:
    server = ServerProcess(
        [*SMALL_SERVER_ARGS, "--dtype", "float32", "--prefix-cache-dir", str(folder / "kv")]
        + list(flags),
        log_path=folder / f"{name}.log",
    )
    server.start()
    return server


def _complete(url: str, rank: int | None = None, **extra: Any) -> tuple[str, int, int]:
    """``PROMPT``'s greedy completion (on engine ``rank`` of ``-dp N``): its text, prompt
    tokens and cached prompt tokens."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}
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
