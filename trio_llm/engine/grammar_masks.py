"""Masking the logits of constrained rows: the tokens each row's llguidance matcher does
not allow are set to -inf before sampling (and before logprobs are taken, so they
describe the distribution actually sampled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trio_llm.structured_output.grammar_check import llguidance_numpy

if TYPE_CHECKING:
    import llguidance
    import torch


def apply_masks(
    logits: torch.Tensor, matchers: list[tuple[int, llguidance.LLMatcher]]
) -> list[tuple[int, Exception]]:
    """Set to -inf, in place, the logits of tokens each row's matcher does not allow.

    A matcher that raises while its mask is filled (a bug in the grammar library, not
    its grammar) leaves its row unmasked and is returned: its request must end with an
    error; the other rows are masked as usual.

    The masks are filled one matcher after another: llguidance's parallel fill (an
    ``LLExecutor``'s threads) was slower on the 2-core machine where the figures are taken
    (docs/structured-output.md).

    Args:
        logits: float32 ``[N, vocab]`` (on any device: the masks are made on the CPU
            and copied over).
        matchers: ``(row, matcher)`` for the constrained rows.

    Returns:
        ``(row, exception)`` of each matcher that failed.
    """
    import torch

    llg_numpy = llguidance_numpy()
    vocab = logits.shape[-1]
    bitmask = llg_numpy.allocate_token_bitmask(len(matchers), vocab)
    failed = []
    for index, (row, matcher) in enumerate(matchers):
        try:
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, index)
        except Exception as exc:
            failed.append((row, exc))
            bitmask[index] = -1  # every token allowed: finite logits for a row that ends
    rows = torch.tensor([row for row, _ in matchers], device=logits.device)
    hidden = _disallowed(bitmask, vocab).to(logits.device)
    logits[rows] = logits[rows].masked_fill(hidden, -torch.inf)
    return failed


def _disallowed(bitmask: Any, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` bool, True where a token is not allowed: token ``t`` is allowed when
    bit ``t % 32`` of word ``t // 32`` of its row of ``bitmask`` (int32 numpy) is set."""
    import numpy as np
    import torch

    words = bitmask.astype("<i4", copy=False)  # little-endian: bit order is token order
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits == 0)
