"""LoRA adapters served over HTTP (issue 45): vLLM's flags and routes, the ``openai`` SDK.

One server of the default model in float32 with ``--enable-lora``: an adapter from
``--lora-modules`` and more loaded at run time from ``--allowed-lora-dir``. Each answer is
peft's merged model's greedy text; hostile loads are 400s naming the field, and loads
while requests stream leave those requests as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import parallel
from tests.support.lora import greedy_reference, merged_model, save_adapter
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess, serve_until_it_exits
from tests.support.tiny_model import save_tiny_model
from trio_llm.config import DEFAULT_MODEL, engine_config
from trio_llm.errors import EngineStartupError
from trio_llm.server.engine_fleet import open_adapters
from trio_llm.server_config import ServerConfig

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 5549, 30]  # token ids: no tokenizer round trip
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    """``sql`` (served from the start), ``code`` and ``big`` (rank 32) in the allowed
    folder, ``outside`` out of it, and ``tiny``: an adapter of another base model."""
    root = tmp_path_factory.mktemp("lora")
    allowed = root / "allowed"
    tiny = save_tiny_model(root / "tiny-model", tokenizer_dir=real_model_dir, vocab_size=49152)
    return {
        "sql": save_adapter(real_model_dir, root / "sql", seed=1, targets=("q_proj", "v_proj")),
        "code": save_adapter(real_model_dir, allowed / "code", seed=2),
        "big": save_adapter(real_model_dir, allowed / "big", seed=3, rank=32),
        "outside": save_adapter(real_model_dir, root / "outside", seed=4),
        "tiny": save_adapter(tiny, allowed / "tiny", seed=5, rank=2),
        "allowed": allowed,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[str]:
    args = [
        *SMALL_SERVER_ARGS,
        *("--dtype", "float32", "--quantization", "none"),
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"),
        *("--lora-modules", f"sql={adapters['sql']}"),
        *("--allow-runtime-lora-updating", "--allowed-lora-dir", str(adapters["allowed"])),
    ]
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with ServerProcess(args, log_path=log) as process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


@functools.cache
def _expected_text(model_dir: Path, adapter: Path | None) -> str:
    from transformers import AutoTokenizer

    tokens, _ = greedy_reference(merged_model(model_dir, adapter), PROMPT, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens)


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _load(url: str, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)


def test_models_lists_each_adapter_with_its_parent(server: str, adapters: dict) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {DEFAULT_MODEL, "sql"}
    assert cards["sql"].parent == DEFAULT_MODEL and cards["sql"].root == str(adapters["sql"])
    assert cards[DEFAULT_MODEL].parent is None


def test_each_adapter_answers_as_peft_merged_it(
    server: str, adapters: dict, real_model_dir: Path
) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    base, sql = parallel(
        lambda: client.completions.create(
            model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        ),
        lambda: client.completions.create(
            model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        ),
    )
    assert base.choices[0].text == _expected_text(real_model_dir, None)
    assert sql.choices[0].text == _expected_text(real_model_dir, adapters["sql"])
    assert sql.model == "sql" and sql.choices[0].text != base.choices[0].text
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert {chunk.model for chunk in chat} == {"sql"}


def test_runtime_loads_while_requests_stream(
    server: str, adapters: dict, real_model_dir: Path
) -> None:
    """Loading ``code`` while base and ``sql`` requests run leaves their answers as they
    were; ``code`` then answers as peft; once unloaded it is a 404."""
    expected = {m: _expected_text(real_model_dir, adapters.get(m)) for m in (DEFAULT_MODEL, "sql")}
    calls = [lambda m=m: _complete(server, m) for m in [DEFAULT_MODEL, "sql"] * 3]
    *answers, loaded = parallel(*calls, lambda: _load(server, "code", adapters["code"]))
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    for answer, model in zip(answers, [DEFAULT_MODEL, "sql"] * 3, strict=True):
        assert answer.json()["choices"][0]["text"] == expected[model]
    code = _complete(server, "code")
    assert code.json()["choices"][0]["text"] == _expected_text(real_model_dir, adapters["code"])
    unload = {"lora_name": "code"}
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json=unload).status_code == 200
    gone = _complete(server, "code")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    again = httpx.post(f"{server}/v1/unload_lora_adapter", json=unload)
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(
    ("name", "path", "param", "says"),
    [
        ("x", "outside", "lora_path", "outside the folder"),
        ("x", "/etc", "lora_path", "outside the folder"),
        ("x", "big", "lora_path", "over --max-lora-rank 16"),
        ("x", "tiny", "lora_path", "another base model"),
        ("x", "missing", "lora_path", "no adapter folder"),
        ("x", "malformed", "lora_path", "cannot be read"),
        ("sql", "code", "lora_name", "taken"),
        (DEFAULT_MODEL, "code", "lora_name", "taken"),
    ],
)
def test_hostile_loads_are_400s_naming_the_field(
    server: str, adapters: dict, name: str, path: str, param: str, says: str
) -> None:
    allowed: Path = adapters["allowed"]
    if path == "malformed":
        folder = allowed / "malformed"
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        (folder / "adapter_model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}garbage")
    target = adapters.get(path) or (path if path.startswith("/") else allowed / path)
    answer = _load(server, name, target)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert _complete(server, "sql").status_code == 200  # the server serves on


def test_a_bad_lora_module_stops_the_start(adapters: dict, real_model_dir: Path) -> None:
    """``open_adapters`` (what the server runs before it serves) refuses a bad
    ``--lora-modules`` with the reason; the config refuses one without ``--enable-lora``."""
    lora = engine_config(enable_lora=True)
    config = ServerConfig(engine=lora, lora_modules=(("big", str(adapters["big"])),))
    with pytest.raises(EngineStartupError, match=r"--lora-modules big=.*--max-lora-rank 16"):
        open_adapters(str(real_model_dir), config)
    with pytest.raises(ValueError, match="need --enable-lora"):
        ServerConfig(lora_modules=(("sql", str(adapters["sql"])),))
    refused = serve_until_it_exits("--lora-modules", f"sql={adapters['sql']}")
    assert refused.returncode != 0 and "need --enable-lora" in refused.stderr
