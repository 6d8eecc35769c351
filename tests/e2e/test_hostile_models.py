"""Hostile clients of a server of several models under ``--api-key`` (issue 41, items 4,
5, 11 and 12, and "routes that need no key never load, unload, pin or name anything on
disk"): one real server of SmolLM2 (``smol``, the default) and a ``--models-dir`` holding
a file that is no GGUF (``zero``) and one whose header claims 4 x 2^62 values (``huge``).

Each test checks what the client gets and that the models are as they were; the server's
log keeps the host paths the bodies leave out. (The rules themselves are pinned by the
unit tests: tests/unit/api/test_open_routes.py, test_model_pool.py, test_weight_headers.py.)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL
from tests.support.server_process import ServerProcess

KEY = "sk-hostile-models"
AUTH = {"authorization": f"Bearer {KEY}"}


def _huge_gguf(path: Path) -> None:
    """A GGUF header of one F32 tensor of 4 x 2^62 values, and no data."""
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    name = b"w"
    header += struct.pack("<Q", len(name)) + name + struct.pack("<IQQIQ", 2, 4, 2**62, 0, 0)
    path.write_bytes(header + b"\0" * (-len(header) % 32))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hostile-models")
    (folder / "zero.gguf").write_bytes(b"")
    _huge_gguf(folder / "huge.gguf")
    return folder


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, real_model_dir: Path
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("hostile-models-server") / "server.log"
    args = ["--dtype", "float32", "--store-url", "none", "--max-num-seqs", "4"]
    args += ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--api-key", KEY]
    args += ["--model", MODEL, "--served-model-name", "smol", "--models-dir", str(models_dir)]
    with ServerProcess(args, log_path=log) as process:
        yield process


def _states(url: str) -> dict[str, str]:
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200
    return {model["model"]: model["state"] for model in health.json()["models"]}


def test_tokenize_without_the_key_changes_no_model(server: ServerProcess) -> None:
    url = server.url
    assert _states(url) == {"smol": "loaded", "huge": "unloaded", "zero": "unloaded"}
    for body in ({"prompt": "hi", "keep_alive": 0}, {"prompt": "hi", "keep_alive": -1}):
        refused = httpx.post(f"{url}/tokenize", json={"model": "smol", **body})
        assert refused.status_code == 401
        assert refused.json()["error"]["param"] == "keep_alive"
    refused = httpx.post(f"{url}/detokenize", json={"model": "zero", "tokens": [1]})
    assert refused.status_code == 503 and "not loaded" in refused.json()["error"]["message"]
    answered = httpx.post(f"{url}/tokenize", json={"model": "smol", "prompt": "hi"})
    assert answered.status_code == 200 and answered.json()["count"] > 0
    assert _states(url) == {"smol": "loaded", "huge": "unloaded", "zero": "unloaded"}


def test_a_keep_alive_past_a_doubles_range_is_a_400(server: ServerProcess) -> None:
    huge = "1" + "0" * 400
    for path, body in (("/v1/completions", '"prompt": "hi"'), ("/tokenize", '"prompt": "hi"')):
        text = f'{{"model": "smol", {body}, "max_tokens": 1, "keep_alive": {huge}}}'
        headers = {**AUTH, "content-type": "application/json"}
        answer = httpx.post(f"{server.url}{path}", content=text, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "keep_alive"


def test_models_that_cannot_load_name_no_host_path_and_unload_nothing(
    server: ServerProcess, models_dir: Path
) -> None:
    url = server.url
    for name, why in (("zero", "not a GGUF file"), ("huge", "past 2^63")):
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        failed = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed" and why in error["message"]
        assert error["message"].startswith(f"the model `{name}` failed to load")
        assert str(models_dir) not in failed.text
    bodies = [
        httpx.get(f"{url}/health").text,
        httpx.get(f"{url}/v1/models", headers=AUTH).text,
        httpx.get(f"{url}/metrics").text,
    ]
    for body in bodies:
        assert str(models_dir) not in body and "/.cache/" not in body
    assert _states(url) == {"smol": "loaded", "huge": "failed", "zero": "failed"}
    assert str(models_dir / "zero.gguf") in server.log()  # the operator's log has it all
    assert "Traceback" not in server.log()
    normal = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=normal, headers=AUTH).status_code == 200
