"""Batched sampling: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import math
from collections import Counter

import torch

from trio_llm.engine.request import Request
from trio_llm.engine.sampler import Sampler
from trio_llm.messages import SamplingParams


def _requests(n: int, **params: object) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def _logits(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([probs] * rows).log()


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert Sampler()(logits, _requests(5, temperature=0.0)) == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_or_temperature_reduce_to_greedy() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 5
    requests = (
        _requests(2, temperature=1.0, top_k=1)
        + _requests(2, temperature=1.0, top_p=1e-6)
        + _requests(2, top_p=1e-300)  # below float32's resolution
        + _requests(2, temperature=1e-40)  # dividing by it would overflow
    )
    assert Sampler()(logits, requests) == logits.argmax(-1).tolist()


def test_mixed_batches_keep_greedy_rows_greedy() -> None:
    logits = _logits([0.1, 0.2, 0.7], rows=40)
    requests = _requests(20, temperature=0.0) + _requests(20, temperature=5.0)
    tokens = Sampler(seed=3)(logits, requests)
    assert tokens[:20] == [2] * 20
    assert len(set(tokens[20:])) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    n = 6000
    tokens = Sampler(seed=0)(_logits(probs, rows=n), _requests(n, temperature=1.0))
    counts = Counter(tokens)
    for token, p in enumerate(probs):
        # Five standard deviations of a binomial count.
        assert abs(counts[token] - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_top_k_and_top_p_exclude_the_tail() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 2000
    top_k = Sampler(seed=1)(_logits(probs, rows=n), _requests(n, top_k=2))
    assert set(top_k) == {0, 1}
    # top_p=0.65: 0.4 + 0.3 reaches it, so tokens 2 and 3 are out.
    top_p = Sampler(seed=2)(_logits(probs, rows=n), _requests(n, top_p=0.65))
    assert set(top_p) == {0, 1}


def test_seeded_rows_repeat_whatever_else_is_sampled() -> None:
    logits = torch.zeros(3, 1000)

    def draw(batch_seed: int, neighbours: int) -> list[int]:
        sampler = Sampler(seed=batch_seed)
        seeded = Request("s", [1], SamplingParams(seed=99))
        out = []
        for _ in range(5):
            requests = [*_requests(neighbours), seeded]
            out.append(sampler(logits[: len(requests)], requests)[-1])
        return out

    assert draw(batch_seed=0, neighbours=0) == draw(batch_seed=7, neighbours=2)
