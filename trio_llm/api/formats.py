"""Output formats: how one response's choices are rendered for the client.

The request path is one (`trio_llm.api.serving`: plan, admit, run the choices); what
differs between endpoints is only how a choice is written out. A `ResponseFormat` renders
the whole response body, each stream chunk (server-sent events) and the chunks a stream
opens with, the ``usage``, and the logprobs of a WebSocket ``delta`` event.
`CompletionFormat` (``/v1/completions``, ``text_completion``) and `ChatFormat`
(``/v1/chat/completions``, ``chat.completion``) are the two today; a new endpoint (the
Responses API, Anthropic Messages) is a new format, not a new request path.

A format instance belongs to one response (its `Plan`): it keeps per-choice state, such
as the text offsets of completion logprobs and whether a choice's first chunk (which
carries an echoed prompt) went out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trio_llm.api.logprobs_format import CompletionLogprobs, chat_logprobs
from trio_llm.api.tools import CallDelta, ToolCallParser
from trio_llm.text.choice import Choice, ChoiceDelta
from trio_llm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from trio_llm.api.plan import Plan


def usage(plan: Plan, choices: list[Choice]) -> dict[str, int]:
    """OpenAI's ``usage``: each prompt counted once, every choice's output tokens."""
    prompt = sum(plan.prompt_lengths)
    completion = sum(choice.num_output_tokens for choice in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class ResponseFormat:
    """Renders the choices of one response (base class; see the module doc).

    Attributes:
        id_prefix: the response ``id``'s prefix (``cmpl``, ``chatcmpl``).
        object: the ``object`` of a whole response.
        chunk_object: the ``object`` of a stream chunk.
    """

    id_prefix = ""
    object = ""
    chunk_object = ""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        """The whole (non-streamed) response body."""
        return {
            "id": plan.response_id,
            "object": self.object,
            "created": plan.created,
            "model": plan.model,
            "choices": [self.final_choice(plan, choice) for choice in choices],
            "usage": usage(plan, choices),
        }

    def chunk(
        self, plan: Plan, entries: list[dict[str, Any]], choices: list[Choice] | None = None
    ) -> dict[str, Any]:
        """One stream chunk carrying the choice ``entries``; with ``choices`` (the
        stream's last chunk, when usage was asked for) the ``usage`` of those."""
        body: dict[str, Any] = {
            "id": plan.response_id,
            "object": self.chunk_object,
            "created": plan.created,
            "model": plan.model,
            "choices": entries,
        }
        if choices is not None:
            body["usage"] = usage(plan, choices)
        return body

    def final_choice(self, plan: Plan, choice: Choice) -> dict[str, Any]:
        """One entry of a whole response's ``choices`` (the choice has finished)."""
        raise NotImplementedError

    def opening_choices(self, plan: Plan, choices: list[Choice]) -> list[dict[str, Any]]:
        """Choice entries of the chunks a stream starts with, one chunk each (none here)."""
        return []

    def chunk_choice(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> dict[str, Any] | None:
        """The ``choices`` entry of the stream chunk that carries ``piece``, or None when
        there is nothing to send yet."""
        raise NotImplementedError

    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        """The ``logprobs`` of the WebSocket ``delta`` event that carries ``piece``
        (only called when the request asked for logprobs)."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """``/v1/completions``: ``text`` and OpenAI's legacy completion logprobs; with
    ``echo``, the prompt (and its logprobs) leads the choice."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self._formatters: dict[int, CompletionLogprobs] = {}
        self._started: set[int] = set()

    def _formatter(self, index: int) -> CompletionLogprobs:
        if index not in self._formatters:
            self._formatters[index] = CompletionLogprobs(self.tokenizer)
        return self._formatters[index]

    def final_choice(self, plan: Plan, choice: Choice) -> dict[str, Any]:
        text = choice.text
        logprobs = None
        if plan.echo:
            text = (plan.echo_texts[choice.index] or "") + text
        if plan.num_top_logprobs is not None:
            prefix: list = [None, *choice.prompt_logprobs] if plan.echo else []
            first_token = plan.requests[choice.index][0][0]
            logprobs = CompletionLogprobs(self.tokenizer).delta(
                prefix + choice.all_logprobs, first_token
            )
        return _choice(choice.index, "text", text, logprobs, choice.finish_reason, choice)

    def chunk_choice(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> dict[str, Any]:
        text = piece.text
        entries: list = list(piece.logprobs)
        first_token = 0
        if plan.echo and choice.index not in self._started:
            # The prompt (and its logprobs) goes out with the choice's first chunk.
            text = (plan.echo_texts[choice.index] or "") + text
            entries = [None, *choice.prompt_logprobs, *entries]
            first_token = plan.requests[choice.index][0][0]
        self._started.add(choice.index)
        logprobs = None
        if plan.num_top_logprobs is not None:
            logprobs = self._formatter(choice.index).delta(entries, first_token)
        return _choice(choice.index, "text", text, logprobs, piece.finish_reason, piece)

    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        return self._formatter(choice.index).delta(list(piece.logprobs))


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: an assistant ``message`` (a ``delta`` when streamed, the
    first one with the role) and chat logprobs.

    With a ``tool_parser`` (a request with tools and a tool_choice other than "none"),
    each choice's text goes through its own parser (`trio_llm.api.tools`): the message
    gets ``content`` and ``tool_calls``, a stream gets ``delta.tool_calls`` pieces (id and
    name first, then the arguments), and a choice that made calls and stopped on its own
    ends with finish_reason "tool_calls".

    Args:
        tool_parser: makes one parser per choice; None for plain text.
        parallel_tool_calls: False keeps only a choice's first call.
    """

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer: Tokenizer,
        tool_parser: Callable[[], ToolCallParser] | None = None,
        *,
        parallel_tool_calls: bool = True,
    ) -> None:
        super().__init__(tokenizer)
        self.tool_parser = tool_parser
        self.parallel_tool_calls = parallel_tool_calls
        self._parsers: dict[int, ToolCallParser] = {}

    def _logprobs(self, plan: Plan, entries: list) -> Any:
        if plan.num_top_logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, entries, plan.num_top_logprobs)

    def _allowed(self, calls: list[CallDelta]) -> list[CallDelta]:
        return calls if self.parallel_tool_calls else [c for c in calls if c.index == 0]

    @staticmethod
    def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and reason == "stop" else reason

    def final_choice(self, plan: Plan, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self.tool_parser is not None:
            parsed = self.tool_parser().parse(choice.text)
            parsed.calls = self._allowed(parsed.calls)
            calls = parsed.tool_calls()
            message["content"] = parsed.content or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
            finish_reason = self._finish_reason(finish_reason, bool(calls))
        logprobs = self._logprobs(plan, choice.all_logprobs)
        return _choice(choice.index, "message", message, logprobs, finish_reason, choice)

    def opening_choices(self, plan: Plan, choices: list[Choice]) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [_choice(choice.index, "delta", role, None, None, None) for choice in choices]

    def chunk_choice(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        logprobs = self._logprobs(plan, piece.logprobs) if piece.logprobs else None
        if self.tool_parser is None:
            if piece.text or piece.finish_reason is None:
                delta["content"] = piece.text
            return _choice(choice.index, "delta", delta, logprobs, piece.finish_reason, piece)
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = self.tool_parser()
        parsed = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parsed.extend(parser.finish())
        calls = self._allowed(parsed.calls)
        if parsed.content or (logprobs is not None and not calls):
            delta["content"] = parsed.content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        if not delta and piece.finish_reason is None:
            return None  # text held back by the parser (a call's beginning, say)
        finish_reason = self._finish_reason(piece.finish_reason, parser.num_calls > 0)
        return _choice(choice.index, "delta", delta, logprobs, finish_reason, piece)

    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        return self._logprobs(plan, piece.logprobs) if piece.logprobs else None


def _choice(
    index: int,
    key: str,
    value: Any,
    logprobs: Any,
    finish_reason: str | None,
    source: Choice | ChoiceDelta | None,
) -> dict[str, Any]:
    """A ``choices`` entry, its fields in the order OpenAI and vLLM send them."""
    return {
        "index": index,
        key: value,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": source.stop_reason if source is not None else None,
    }
