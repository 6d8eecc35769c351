"""One choice of a completion: engine token deltas in, text and logprob deltas out.

Each choice (one prompt, one of its ``n`` samples) runs its own incremental detokenizer
and stop-string matcher. Tokens whose text is held back (an incomplete character, or text
that may start a stop string) keep their logprobs pending too, so every emitted delta
carries exactly the logprobs of the tokens behind its text.

Finishing follows vLLM: a request that ends on EOS or one of ``stop_token_ids`` reports
``finish_reason "stop"``; the stop token's text is left out unless
``include_stop_str_in_output``, and ``stop_reason`` is the stop token id (None for EOS).
A stop string ends the choice with ``stop_reason`` set to that string; only a stop string
that ends once ``min_tokens`` tokens were generated counts (as in vLLM, it may begin
earlier).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trio_llm.detokenizer import IncrementalDetokenizer, StopMatcher
from trio_llm.frontend.engine_client import TokenDelta
from trio_llm.frontend.tokenizer import Tokenizer
from trio_llm.messages import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class OutputOptions:
    """How a choice's tokens become text (the API-side part of a request's parameters)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class ChoiceDelta:
    """New output of one choice.

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


class Choice:
    """Turns one engine request's `TokenDelta`s into `ChoiceDelta`s.

    Args:
        index: the choice's ``index`` in the response.
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt (decoding context for the first output tokens).
        params: the request's engine parameters (``stop_token_ids``, ``min_tokens``).
        options: stop strings and detokenization options.
        eos_token_ids: the model's EOS ids.
    """

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: OutputOptions,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.index = index
        self.params = params
        self.options = options
        self.eos_token_ids = eos_token_ids
        self.detokenizer = IncrementalDetokenizer(
            tokenizer.backend, prompt_token_ids, skip_special_tokens=options.skip_special_tokens
        )
        self.matcher = StopMatcher(
            options.stop, include_stop_str_in_output=options.include_stop_str_in_output
        )
        self.num_output_tokens = 0
        self.text = ""
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.all_logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._pending_logprobs: list[TokenLogprobs] = []

    @property
    def finished(self) -> bool:
        """True once the choice has its finish_reason."""
        return self.finish_reason is not None

    def process(self, delta: TokenDelta) -> ChoiceDelta | None:
        """Take the engine's next delta; return what to emit now, or None if nothing."""
        if self.finished:
            return None
        tokens = delta.token_ids
        self.num_output_tokens += len(tokens)
        if delta.prompt_logprobs:
            self.prompt_logprobs += delta.prompt_logprobs
        logprobs = delta.logprobs or []
        finish_reason, stop_reason = delta.finish_reason, None
        text_tokens = tokens
        if finish_reason == "stop" and tokens:
            last = tokens[-1]
            if last in self.params.stop_token_ids and last not in self._eos_if_active:
                stop_reason = last
            if not self.options.include_stop_str_in_output:
                # The stop token is not part of the text, so not of the logprobs either
                # (OpenAI: the logprob tokens spell the content).
                text_tokens = tokens[:-1]
                logprobs = logprobs[: len(text_tokens)]
        self._pending_logprobs += logprobs
        finished = finish_reason is not None
        text = self.detokenizer.add_tokens(text_tokens, finished=finished)
        if self.options.stop:
            allowed = self.num_output_tokens >= self.params.min_tokens
            text = self.matcher.feed(text, finished=finished, stop_allowed=allowed)
            if self.matcher.stopped:
                finish_reason, stop_reason = "stop", self.matcher.stop_string
        if not text and finish_reason is None:
            return None
        self.text += text
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        self.all_logprobs += logprobs
        return ChoiceDelta(text, logprobs, finish_reason, stop_reason)

    @property
    def _eos_if_active(self) -> frozenset[int]:
        return frozenset() if self.params.ignore_eos else self.eos_token_ids
