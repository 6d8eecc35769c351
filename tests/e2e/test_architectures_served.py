"""Two of the conformance suite's architectures served through the real processes
(`trio-llm serve`, 2 and 3 processes): greedy completions and their logprobs as
transformers computes them. Gemma 2 carries sliding windows narrower than the prompts and
both softcaps; Phi an output projection with a bias and partial rotary embeddings.
(tests/unit/engine/test_conformance.py proves the same in-process for every architecture.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.architectures import build_model, save_for_serving
from tests.support.server_process import ServerProcess

VOCAB = 49152  # SmolLM2's tokenizer
PROMPTS = [list(range(1000, 1040)), [7, 300, 9, 12345] * 17, list(range(20000, 20005))]
MAX_TOKENS = 8
CASES = [("gemma2", "inline"), ("gemma2", "process"), ("phi", "inline")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Iterator[tuple[str, str, str]]:
    name, mode = request.param
    folder = save_for_serving(name, tmp_path_factory.mktemp(name), real_model_dir, VOCAB)
    args = ["--model", str(folder), "--dtype", "float32", "--max-model-len", "128"]
    args += ["--max-num-batched-tokens", "16", "--kv-cache-memory", "64MiB"]
    args += ["--detokenizer-mode", mode]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("log") / "server.log") as server:
        yield name, server.url, str(folder)


def _reference(name: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of generate() and their logprobs from one full forward pass."""
    model = build_model(name, VOCAB)
    with torch.inference_mode():
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )[0]
        logprobs = model(ids[None]).logits[0].float().log_softmax(-1)
    tokens = ids[len(prompt) :].tolist()
    return tokens, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_greedy_completions_and_logprobs_match_transformers(
    served: tuple[str, str, str], smol_tokenizer
) -> None:
    name, url, folder = served
    for prompt in PROMPTS:
        body = {
            "model": folder,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        tokens, logprobs = _reference(name, prompt)
        assert choice["text"] == smol_tokenizer.decode(tokens)
        served_logprobs = choice["logprobs"]["token_logprobs"]
        assert served_logprobs == pytest.approx(logprobs, abs=1e-4)
