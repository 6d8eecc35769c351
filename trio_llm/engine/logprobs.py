"""Log-probabilities of chosen tokens and their best alternatives, as `TokenLogprobs`."""

from __future__ import annotations

import torch

from trio_llm.messages import TokenLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """One `TokenLogprobs` per row.

    Args:
        logprobs: float32 ``[N, vocab]`` log-softmax rows (``-inf`` allowed).
        token_ids: int64 ``[N]``, the token whose logprob row ``i`` reports.
        num_top: ``N`` counts of alternatives to list per row (0 lists none).

    Returns:
        ``N`` entries; ``rank`` is 1 + the number of tokens with a strictly higher logprob.
    """
    if logprobs.shape[0] == 0:
        return []
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k = max(num_top)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    chosen_list, ranks_list, ids = chosen[:, 0].tolist(), ranks.tolist(), token_ids.tolist()
    entries = []
    for row, n in enumerate(num_top):
        entries.append(
            TokenLogprobs(
                token_id=ids[row],
                logprob=chosen_list[row],
                rank=ranks_list[row],
                top_token_ids=top_ids_list[row][:n] if n else [],
                top_logprobs=top_values_list[row][:n] if n else [],
            )
        )
    return entries
