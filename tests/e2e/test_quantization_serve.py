"""`trio-llm serve --quantization int8`: the flag reaches the engine, which answers.

The quantized engine's numerics are tested in tests/unit/engine/test_quantization.py against
the dequantized float model; here the real model, loaded from its GGUF, is served with
int8 weights through the server's processes, and answers the question every float32
test asks it the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = Path(tmp_path_factory.mktemp("int8")) / "server.log"
    with ServerProcess(
        ["--quantization", "int8", "--max-num-seqs", "4", "--dtype", "float32"], log_path=log
    ) as server:
        yield server


def test_int8_server_answers_like_the_float_model(int8_server: ServerProcess) -> None:
    reply = httpx.post(
        f"{int8_server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]
    log = int8_server.log_path.read_text()
    assert "(trio_llm's forward, int8)" in log


def test_bad_quantization_is_a_usage_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "trio_llm", "serve", "--quantization", "fp8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--quantization" in result.stderr and "int8" in result.stderr
