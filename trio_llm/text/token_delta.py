"""`TokenDelta`: one engine request's output since its consumer last looked.

The engine handle's request streams (`trio_llm.frontend.request_stream.RequestStream`)
yield them; a `trio_llm.text.choice.Choice` turns them into text. It lives here, beside
its consumer, so that `text/` needs nothing of `frontend/`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trio_llm.messages import TokenLogprobs


@dataclass
class TokenDelta:
    """Output of one request that arrived since the consumer last looked.

    Attributes:
        token_ids: new output token ids, oldest first (may be empty on the final delta).
        finish_reason: None while running, else "stop", "length" or "abort".
        logprobs: one entry per new token when the request asked for logprobs, else None.
        prompt_logprobs: new prompt-position entries when asked for, else None.
        text: None when the API server detokenizes (inline mode). In 3-process mode the
            text the detokenizer child released for these tokens; ``logprobs`` are then
            those of the tokens behind that text, and ``stop_reason`` is set.
        stop_reason: with ``text``: the matched stop string or stop token id.
        embedding: an embedding model's vector, on the finishing delta.
        num_cached_tokens: on the request's first delta: prompt tokens that came from
            the prefix cache (`trio_llm.messages.RequestOutput.num_cached_tokens`).
    """

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    text: str | None = None
    stop_reason: str | int | None = None
    embedding: list[float] | None = None
    num_cached_tokens: int | None = None
