"""One choice of a completion: engine token deltas in, text and logprob deltas out.

Each choice (one prompt, one of its ``n`` samples) is one engine request. Its text comes
from a `RequestDetokenizer` (stop tokens, stop strings, logprobs aligned with the text):
run here, in the API server, in inline mode; in the detokenizer child in 3-process mode,
whose deltas arrive with their text already set and are taken as they are.
"""

from __future__ import annotations

from trio_llm.messages import SamplingParams, TokenLogprobs
from trio_llm.text.output import RequestDetokenizer, TextDelta
from trio_llm.text.token_delta import TokenDelta
from trio_llm.text.tokenizer import Tokenizer

#: New output of one choice (text, logprobs behind it, finish_reason, stop_reason).
ChoiceDelta = TextDelta


class Choice:
    """Turns one engine request's `TokenDelta`s into `ChoiceDelta`s and keeps the totals.

    Args:
        index: the choice's ``index`` in the response.
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt (decoding context for the first output tokens).
        params: the request's parameters (stop strings, stop tokens, detokenization).
        eos_token_ids: the model's EOS ids.
    """

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.index = index
        self.params = params
        self._tokenizer = tokenizer
        self._prompt_token_ids = prompt_token_ids
        self._eos_token_ids = eos_token_ids
        # Built on the first delta without text (inline mode): in 3-process mode the
        # detokenizer child makes the text and none is needed here.
        self._detokenizer: RequestDetokenizer | None = None
        self.num_output_tokens = 0
        self.text = ""
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.all_logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        #: Prompt tokens that came from the prefix cache (the engine's first output).
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        """True once the choice has its finish_reason."""
        return self.finish_reason is not None

    def process(self, delta: TokenDelta) -> ChoiceDelta | None:
        """Take the engine's next delta; return what to emit now, or None if nothing."""
        if self.finished:
            return None
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs:
            self.prompt_logprobs += delta.prompt_logprobs
        piece: ChoiceDelta | None = None
        if delta.text is None:
            if self._detokenizer is None:
                self._detokenizer = RequestDetokenizer(
                    self._tokenizer.backend,
                    self._prompt_token_ids,
                    self.params,
                    self._eos_token_ids,
                )
            piece = self._detokenizer.process(delta.token_ids, delta.finish_reason, delta.logprobs)
            # Tokens after a stop string are not output (nor counted in usage).
            self.num_output_tokens = self._detokenizer.num_output_tokens
        else:
            # Detokenized in the detokenizer child already.
            self.num_output_tokens += len(delta.token_ids)
            if delta.text or delta.finish_reason is not None:
                piece = ChoiceDelta(
                    delta.text, delta.logprobs or [], delta.finish_reason, delta.stop_reason
                )
        if piece is None:
            return None
        self.text += piece.text
        self.all_logprobs += piece.logprobs
        self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
        return piece
