"""Logprobs in the two OpenAI wire formats.

Completions (legacy, ``logprobs: k``)::

    {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
     "text_offset": [int]}

``top_logprobs`` maps the ``k`` most likely tokens plus the chosen one to their logprobs;
``null`` marks the first prompt token (echo), which has no logprob. ``text_offset`` is each
token's character offset in the choice's text, counting token texts as vLLM does.

Chat (``logprobs: true, top_logprobs: k``)::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token", "logprob", "bytes"}]}]}

JSON has no infinity: a logprob of ``-inf`` (a token outside top-k/top-p) is sent as
-9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from typing import Any

from trio_llm.messages import TokenLogprobs
from trio_llm.text.tokenizer import Tokenizer

#: What a ``-inf`` logprob is sent as.
NEG_INF_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """``logprob`` with ``-inf`` (and NaN) replaced by `NEG_INF_LOGPROB`."""
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


class CompletionLogprobs:
    """Accumulates a completion choice's logprobs; `delta` formats one chunk's worth.

    Text offsets count from 0, the start of the choice's text (an echoed prompt
    included: its tokens go through `delta` first).

    Args:
        tokenizer: for token texts.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def delta(self, entries: list[TokenLogprobs | None], first_token_id: int = 0) -> dict:
        """Format ``entries`` (None for a position without logprob, whose token is
        ``first_token_id``) and advance the text offset."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        text_of = self.tokenizer.token_text
        for entry in entries:
            token_id = first_token_id if entry is None else entry.token_id
            token = text_of(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            top = {
                text_of(t): finite(lp)
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            }
            top.setdefault(token, finite(entry.logprob))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], num_top: int
) -> dict[str, list[dict[str, Any]]]:
    """``{"content": [...]}`` for chat, ``num_top`` alternatives per token."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": tokenizer.token_text(token_id),
            "logprob": finite(logprob),
            "bytes": tokenizer.token_bytes(token_id),
        }

    content = []
    for entry in entries:
        top = [
            item(t, lp)
            for t, lp in zip(
                entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=True
            )
        ]
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": top})
    return {"content": content}


def vllm_prompt_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice: None for the first prompt token
    (nothing comes before it), then per position a map from token id (as JSON text) to
    ``{"logprob", "rank", "decoded_token"}`` holding the prompt's token and the
    ``num_top`` most likely ones (rank 1 is the most likely)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        position: dict[str, dict[str, Any]] = {}
        tops = zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=True)
        for rank, (token_id, logprob) in enumerate(tops, start=1):
            position[str(token_id)] = {
                "logprob": finite(logprob),
                "rank": rank,
                "decoded_token": tokenizer.token_text(token_id),
            }
        position[str(entry.token_id)] = {
            "logprob": finite(entry.logprob),
            "rank": entry.rank,
            "decoded_token": tokenizer.token_text(entry.token_id),
        }
        out.append(position)
    return out
