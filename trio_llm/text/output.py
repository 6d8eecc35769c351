"""One request's output processing: tokens in, text deltas with their logprobs out.

`RequestDetokenizer` runs the incremental detokenizer and the stop-string matcher of one
engine request. The same class serves both process layouts: the API server runs it per
choice (``--detokenizer-mode inline``), the detokenizer child runs it per request
(``--detokenizer-mode process``) and ships the resulting `TextDelta` fields inside
`trio_llm.messages.RequestOutput`.

Tokens whose text is held back (an incomplete character, or text that may start a stop
string) keep their logprobs pending too, so every delta carries exactly the logprobs of
the tokens behind its text.

Finishing follows vLLM: a request that ends on EOS or one of ``stop_token_ids`` reports
finish_reason "stop"; the stop token's text is left out unless
``include_stop_str_in_output``, and ``stop_reason`` is the stop token id (None for EOS).
A stop string ends the request with ``stop_reason`` set to that string; only a stop
string that ends once ``min_tokens`` tokens were generated counts (as in vLLM, it may begin
earlier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from trio_llm.messages import SamplingParams, TokenLogprobs
from trio_llm.text.incremental import IncrementalDetokenizer
from trio_llm.text.stop import StopMatcher


@dataclass
class TextDelta:
    """New output of one request.

    Attributes:
        text: newly released text.
        logprobs: entries of the output tokens behind ``text`` (when asked for).
        finish_reason: None while running; "stop", "length" or "abort" at the end.
        stop_reason: the matched stop string or stop token id, else None.
    """

    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDetokenizer:
    """Turns one engine request's token deltas into `TextDelta`s.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer`` (fast backend).
        prompt_token_ids: the prompt (decoding context for the first output tokens).
        params: the request's parameters (``stop``, ``stop_token_ids``, ``min_tokens``,
            ``include_stop_str_in_output``, ``skip_special_tokens``, ``ignore_eos``).
        eos_token_ids: the model's EOS ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.matcher = StopMatcher(
            params.stop, include_stop_str_in_output=params.include_stop_str_in_output
        )
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._pending_logprobs: list[TokenLogprobs] = []

    @property
    def finished(self) -> bool:
        """True once the request has its finish_reason (later input is ignored)."""
        return self.finish_reason is not None

    def process(
        self,
        token_ids: Sequence[int],
        finish_reason: str | None = None,
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> TextDelta | None:
        """Take the engine's next tokens; return what to emit now, or None if nothing.

        Several tokens are taken one at a time, so a stop string ends the output at the
        same token however the tokens were batched (``num_output_tokens`` then stops at
        that token too, and the rest are ignored).

        Args:
            token_ids: new output tokens, oldest first (may be empty on the last call).
            finish_reason: the engine's finish_reason, set on the request's last output.
            logprobs: one entry per new token when the request asked for logprobs.
        """
        if self.finished:
            return None
        if len(token_ids) <= 1:
            return self._process(token_ids, finish_reason, logprobs)
        merged: TextDelta | None = None
        last = len(token_ids) - 1
        for i, token in enumerate(token_ids):
            entries = logprobs[i : i + 1] if logprobs is not None else None
            piece = self._process([token], finish_reason if i == last else None, entries)
            if piece is not None:
                if merged is None:
                    merged = piece
                else:
                    merged.text += piece.text
                    merged.logprobs += piece.logprobs
                    merged.finish_reason = piece.finish_reason
                    merged.stop_reason = piece.stop_reason
            if self.finished:
                break
        return merged

    def _process(
        self,
        token_ids: Sequence[int],
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] | None,
    ) -> TextDelta | None:
        self.num_output_tokens += len(token_ids)
        entries = list(logprobs or ())
        stop_reason: str | int | None = None
        text_tokens = token_ids
        if finish_reason == "stop" and token_ids:
            last = token_ids[-1]
            if last in self.params.stop_token_ids and last not in self.eos_token_ids:
                stop_reason = last
            # A "stop" on any other token (a structured output whose grammar is complete)
            # ends on content, which stays in the text.
            is_stop_token = last in self.params.stop_token_ids or last in self.eos_token_ids
            if is_stop_token and not self.params.include_stop_str_in_output:
                # The stop token is not part of the text, so not of the logprobs either
                # (OpenAI: the logprob tokens spell the content).
                text_tokens = token_ids[:-1]
                entries = entries[: len(text_tokens)]
        self._pending_logprobs += entries
        finished = finish_reason is not None
        text = self.detokenizer.add_tokens(list(text_tokens), finished=finished)
        if self.params.stop:
            allowed = self.num_output_tokens >= self.params.min_tokens
            text = self.matcher.feed(text, finished=finished, stop_allowed=allowed)
            if self.matcher.stopped:
                finish_reason, stop_reason = "stop", self.matcher.stop_string
        if not text and finish_reason is None:
            return None
        self.finish_reason = finish_reason
        released, self._pending_logprobs = self._pending_logprobs, []
        return TextDelta(text, released, finish_reason, stop_reason)
