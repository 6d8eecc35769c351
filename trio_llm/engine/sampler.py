"""Batched next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential-race form of the categorical draw: with ``q ~ Exp(1)``
independently per token, ``argmax(p / q)`` is distributed as ``p`` (Gumbel-max trick in
another guise). Rows with a seed draw their ``q`` from their own generator, so their
output does not depend on what else is in the batch; the rest share the engine's.
"""

from __future__ import annotations

import torch

from trio_llm.engine.request import Request


class Sampler:
    """Picks one token per row of a logits matrix.

    Args:
        seed: seed of the generator shared by requests without their own seed.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Sample a token for each request.

        Args:
            logits: float32 ``[N, vocab]``, row ``i`` for ``requests[i]``.

        Returns:
            ``N`` token ids.
        """
        if not requests:
            return []
        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()

        temperature = torch.tensor(
            [r.params.temperature if not g else 1.0 for r, g in zip(requests, greedy, strict=True)]
        )
        logits = logits / temperature[:, None]
        logits = _apply_top_k_top_p(logits, requests)
        probs = logits.softmax(dim=-1)

        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.generator is not None:
                q[row].exponential_(generator=request.generator)
        sampled = (probs / q).argmax(dim=-1)
        greedy_rows = [row for row, g in enumerate(greedy) if g]
        if greedy_rows:
            rows = torch.tensor(greedy_rows)
            sampled[rows] = logits[rows].argmax(dim=-1)
        return sampled.tolist()


def _apply_top_k_top_p(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (rows without either untouched)."""
    vocab = logits.shape[-1]
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in requests]
    top_p = [r.params.top_p for r in requests]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= torch.tensor(top_k)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (the first token
    # always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= torch.tensor(top_p)[:, None]
    remove[:, 0] = False  # a top_p below float32's resolution must not remove everything
    sorted_logits = sorted_logits.masked_fill(remove, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
