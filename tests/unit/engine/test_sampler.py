"""Batched sampling: every SamplingParams field the sampler reads, and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import torch

from trio_llm.engine.request import Request
from trio_llm.engine.sampler import Sampler
from trio_llm.messages import SamplingParams


def _requests(n: int, **params: object) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def _sample(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return sampler(logits.clone(), requests).token_ids


def _logits(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([probs] * rows).log()


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert _sample(Sampler(), logits, _requests(5, temperature=0.0)) == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_or_temperature_reduce_to_greedy() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 5
    requests = (
        _requests(2, temperature=1.0, top_k=1)
        + _requests(2, temperature=1.0, top_p=1e-6)
        + _requests(2, top_p=1e-300)  # below float32's resolution
        + _requests(2, temperature=1e-40)  # dividing by it would overflow
    )
    assert _sample(Sampler(), logits, requests) == logits.argmax(-1).tolist()


def test_mixed_batches_keep_greedy_rows_greedy() -> None:
    logits = _logits([0.1, 0.2, 0.7], rows=40)
    requests = _requests(20, temperature=0.0) + _requests(20, temperature=5.0)
    tokens = _sample(Sampler(seed=3), logits, requests)
    assert tokens[:20] == [2] * 20
    assert len(set(tokens[20:])) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    n = 6000
    tokens = _sample(Sampler(seed=0), _logits(probs, rows=n), _requests(n, temperature=1.0))
    counts = Counter(tokens)
    for token, p in enumerate(probs):
        # Five standard deviations of a binomial count.
        assert abs(counts[token] - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_top_k_and_top_p_exclude_the_tail() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 2000
    top_k = _sample(Sampler(seed=1), _logits(probs, rows=n), _requests(n, top_k=2))
    assert set(top_k) == {0, 1}
    # top_p=0.65: 0.4 + 0.3 reaches it, so tokens 2 and 3 are out.
    top_p = _sample(Sampler(seed=2), _logits(probs, rows=n), _requests(n, top_p=0.65))
    assert set(top_p) == {0, 1}


def test_seeded_rows_repeat_whatever_else_is_sampled() -> None:
    logits = torch.zeros(3, 1000)

    def draw(batch_seed: int, neighbours: int) -> list[int]:
        sampler = Sampler(seed=batch_seed)
        seeded = Request("s", [1], SamplingParams(seed=99))
        out = []
        for _ in range(5):
            requests = [*_requests(neighbours), seeded]
            out.append(_sample(sampler, logits[: len(requests)], requests)[-1])
        return out

    assert draw(batch_seed=0, neighbours=0) == draw(batch_seed=7, neighbours=2)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 2000
    # min_p=0.25: the threshold is 0.125, so tokens 0-2 stay and token 3 goes.
    tokens = _sample(Sampler(seed=4), _logits(probs, rows=n), _requests(n, min_p=0.25))
    assert set(tokens) == {0, 1, 2}


def test_logit_bias_can_force_or_forbid_a_token() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    best = int(logits[0].argmax())
    forced = Request("a", [1], SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)))
    banned = Request("b", [1], SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)))
    tokens = _sample(Sampler(), logits, [forced, banned])
    assert tokens[0] == 7
    assert tokens[1] != best
    assert tokens[1] == int(logits[1].clone().index_fill_(0, torch.tensor([best]), -1e9).argmax())


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 10.0  # EOS, by far the most likely
    logits[0, 4] = 9.0  # a stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    request = Request("r", [1], params)
    sampler = Sampler(eos_token_ids=frozenset({3}))
    assert _sample(sampler, logits, [request]) == [0]  # the best token left
    request.token_ids.append(0)
    assert _sample(sampler, logits, [request]) == [0]
    request.token_ids.append(0)  # two output tokens: min_tokens reached
    assert _sample(sampler, logits, [request]) == [3]


def test_penalties_follow_their_formulas() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]])
    request = Request("r", [0, 1], SamplingParams())  # prompt: tokens 0 and 1
    request.token_ids += [2, 2, 3]  # output: token 2 twice, token 3 once

    def processed(**params: object) -> list[float]:
        request.params = SamplingParams(**params)
        out = logits.clone()
        Sampler()._process(out, [request])
        return out[0].tolist()

    # Repetition: prompt and output tokens; positive divided, negative multiplied.
    assert processed(repetition_penalty=2.0) == [1.0, -4.0, 0.5, 0.25, 0.0]
    # Frequency: output tokens only, once per occurrence.
    assert processed(frequency_penalty=0.5) == [2.0, -2.0, 0.0, 0.0, 0.0]
    # Presence: output tokens only, once.
    assert processed(presence_penalty=0.5) == [2.0, -2.0, 0.5, 0.0, 0.0]


def test_logprobs_are_the_log_softmax_of_what_was_sampled() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    requests = [
        Request("g", [1], SamplingParams(temperature=0.0, logprobs=3)),
        Request("t", [1], SamplingParams(temperature=0.5, logprobs=0, seed=1)),
        Request("k", [1], SamplingParams(temperature=1.0, top_k=2, logprobs=4, seed=2)),
    ]
    out = Sampler()(logits.clone(), requests)
    greedy, tempered, top_k = out.logprobs
    expected = logits[0].log_softmax(-1)
    assert greedy.token_id == out.token_ids[0] == int(logits[0].argmax())
    assert greedy.rank == 1
    assert math.isclose(greedy.logprob, float(expected.max()), abs_tol=1e-6)
    assert greedy.top_token_ids == expected.topk(3).indices.tolist()
    # Temperature 0.5 sharpens the distribution the token was drawn from.
    scaled = (logits[1] / 0.5).log_softmax(-1)
    assert math.isclose(tempered.logprob, float(scaled[out.token_ids[1]]), abs_tol=1e-5)
    assert tempered.top_token_ids == []
    # top_k=2: the two kept tokens share all the mass, the rest are -inf.
    assert math.isclose(sum(math.exp(v) for v in top_k.top_logprobs[:2]), 1.0, abs_tol=1e-5)
    assert top_k.top_logprobs[2:] == [-math.inf, -math.inf]
    assert out.token_ids[2] in top_k.top_token_ids[:2]


def test_rows_without_logprobs_report_none() -> None:
    out = Sampler()(torch.randn(2, 10), _requests(2))
    assert out.logprobs == [None, None]
