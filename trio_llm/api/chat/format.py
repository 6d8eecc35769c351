"""Output formats: how one response's choices are rendered for the client.

The request path is one (`trio_llm.api.chat.serving`: plan, admit, run the choices); what
differs between endpoints is only how a choice is written out, by a `ResponseFormat`
(`trio_llm.api.chat.plan`). `CompletionFormat` (``/v1/completions``,
``text_completion``) and `ChatFormat` (``/v1/chat/completions``, ``chat.completion``) are
here, and `BlockFormat`, the base of the formats that write a chat response's message
(text and tool calls) as blocks in their own shapes: the Anthropic Messages format
(`trio_llm.api.anthropic.format`) and the Responses format
(`trio_llm.api.responses.format`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from trio_llm.api.chat.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from trio_llm.api.chat.plan import Event, Plan, ResponseFormat, choice_entry
from trio_llm.api.tools.calls import CallDelta, ParsedDelta, ToolCallParser
from trio_llm.text.choice import Choice, ChoiceDelta
from trio_llm.text.reasoning import ReasoningDelta, ReasoningParser
from trio_llm.text.tokenizer import Tokenizer


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
        entry = choice_entry(choice.index, "text", text, logprobs, choice.finish_reason, choice)
        if plan.num_prompt_logprobs is not None:
            entry["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tokenizer, choice.prompt_logprobs, plan.num_prompt_logprobs
            )
        return entry

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
        return choice_entry(choice.index, "text", text, logprobs, piece.finish_reason, piece)

    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        return self._formatter(choice.index).delta(list(piece.logprobs))


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: an assistant ``message`` (a ``delta`` when streamed; a
    choice's first chunk carries the role with its first content) and chat logprobs.

    With a ``tool_parser`` (a request with tools and a tool_choice other than "none"),
    each choice's text goes through its own parser (`trio_llm.api.tools.parsers`): the message
    gets ``content`` and ``tool_calls``, a stream gets ``delta.tool_calls`` pieces (id and
    name first, then the arguments), and a choice that made calls and stopped on its own
    ends with finish_reason "tool_calls".

    With a ``reasoning_parser`` (``--reasoning-parser``), each choice's text goes through
    it first (`trio_llm.text.reasoning`): the reasoning becomes the message's
    ``reasoning`` and ``reasoning_content`` (vLLM's newer and older names, both sent; null
    without reasoning), streamed as ``delta.reasoning`` / ``delta.reasoning_content``, and
    only the rest (the answer) is ``content`` and goes on to the tool-call parser.

    Args:
        tool_parser: makes one parser per choice; None for plain text.
        parallel_tool_calls: False keeps only a choice's first call.
        reasoning_parser: makes one reasoning parser per choice; None: no reasoning.
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
        reasoning_parser: Callable[[], ReasoningParser] | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.tool_parser = tool_parser
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoning_parser = reasoning_parser
        self._parsers: dict[int, ToolCallParser] = {}
        self._reasoners: dict[int, ReasoningParser] = {}
        self._role_sent: set[int] = set()

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
        text, reasoning = choice.text, None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser().parse(text)
            text, reasoning = split.content, split.reasoning or None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = choice.finish_reason
        if self.tool_parser is not None:
            parsed = self.tool_parser().parse(text)
            parsed.calls = self._allowed(parsed.calls)
            calls = parsed.tool_calls()
            message["content"] = parsed.content or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
            finish_reason = self._finish_reason(finish_reason, bool(calls))
        if self.reasoning_parser is not None:
            if reasoning is not None and not message["content"]:
                message["content"] = None  # all reasoning (vLLM's null content)
            message["reasoning"] = message["reasoning_content"] = reasoning
        logprobs = self._logprobs(plan, choice.all_logprobs)
        return choice_entry(choice.index, "message", message, logprobs, finish_reason, choice)

    def chunk_choice(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> dict[str, Any] | None:
        entry = self._chunk_choice(plan, choice, piece)
        if entry is not None and choice.index not in self._role_sent:
            # The role rides on the choice's first chunk, with its first generated content
            # (as vLLM sends it): a client that times the first chunk with `choices` as the
            # first token (vLLM's benchmark_serving.py) then measures the real TTFT.
            self._role_sent.add(choice.index)
            entry["delta"] = {"role": "assistant", **entry["delta"]}
        return entry

    def _chunk_choice(
        self, plan: Plan, choice: Choice, piece: ChoiceDelta
    ) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        logprobs = self._logprobs(plan, piece.logprobs) if piece.logprobs else None
        text = piece.text
        if self.reasoning_parser is not None:
            split = self._reason(choice.index, piece)
            text = split.content
            if split.reasoning:
                delta["reasoning"] = delta["reasoning_content"] = split.reasoning
        if self.tool_parser is None:
            plain = self.reasoning_parser is None or logprobs is not None
            if text or (piece.finish_reason is None and not delta and plain):
                delta["content"] = text
            if not delta and piece.finish_reason is None and logprobs is None:
                return None  # text held back by the reasoning parser (a tag's beginning)
            return choice_entry(choice.index, "delta", delta, logprobs, piece.finish_reason, piece)
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = self.tool_parser()
        parsed = parser.feed(text)
        if piece.finish_reason is not None:
            parsed.extend(parser.finish())
        # One entry per call in a chunk: a call's name and its first arguments arrive as
        # two pieces when released together.
        merged = ParsedDelta()
        merged.extend(ParsedDelta(calls=self._allowed(parsed.calls)))
        calls = merged.calls
        if parsed.content or (logprobs is not None and not calls and not delta):
            delta["content"] = parsed.content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        if not delta and piece.finish_reason is None:
            return None  # text held back by the parser (a call's beginning, say)
        finish_reason = self._finish_reason(piece.finish_reason, parser.num_calls > 0)
        return choice_entry(choice.index, "delta", delta, logprobs, finish_reason, piece)

    def _reason(self, index: int, piece: ChoiceDelta) -> ReasoningDelta:
        """``piece``'s text through choice ``index``'s reasoning parser."""
        parser = self._reasoners.get(index)
        if parser is None:
            if self.reasoning_parser is None:
                raise RuntimeError("reasoning split without a reasoning parser")
            parser = self._reasoners[index] = self.reasoning_parser()
        split = parser.feed(piece.text)
        if piece.finish_reason is not None:
            split.extend(parser.finish())
        return split

    def delta_logprobs(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> Any:
        return self._logprobs(plan, piece.logprobs) if piece.logprobs else None


@dataclass
class Block:
    """One block of an assistant message rendered as a list of blocks (Anthropic's
    content blocks, the Responses API's output items).

    Attributes:
        kind: ``"text"``, ``"call"`` (a tool call) or ``"thinking"`` (the model's
            reasoning, with a ``--reasoning-parser``; it comes first).
        index: the block's position in the message, from 0.
        text: the text so far, or a call's arguments (JSON text) so far.
        call_id: a call's id.
        name: a call's function name.
    """

    kind: Literal["text", "call", "thinking"]
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None


class BlockFormat(ChatFormat, ABC):
    """A chat response written as blocks: a thinking block (with a reasoning parser),
    text blocks and tool-call blocks, in order.

    The chat format does the work (text, the tool-call parser, the finish reason); this
    base turns each choice's message, or each of its chunks' deltas, into `Block`\\ s
    and calls the subclass's hooks: `block_started`, `block_delta`, `block_stopped`
    and `message_finished` while streaming, `blocks` for a whole response. Only one
    choice per response (neither API has ``n``). Takes `ChatFormat`'s arguments.
    """

    # Per-response state (class defaults; each instance sets its own as it streams).
    _open: Block | None = None
    _num_blocks = 0
    #: The chat finish reason once the message ended (set before its last block
    #: closes), else None.
    finish_reason: str | None = None

    def blocks(self, plan: Plan, choice: Choice) -> tuple[list[Block], str | None]:
        """The whole message of a finished choice as blocks, and its chat finish reason
        (``"tool_calls"`` when it stopped after making calls)."""
        entry = self.final_choice(plan, choice)
        message = entry["message"]
        blocks = []
        if message.get("reasoning"):
            blocks.append(Block("thinking", 0, message["reasoning"]))
        if message["content"]:
            blocks.append(Block("text", len(blocks), message["content"]))
        for call in message.get("tool_calls", ()):
            function = call["function"]
            blocks.append(
                Block("call", len(blocks), function["arguments"], call["id"], function["name"])
            )
        return blocks, entry["finish_reason"]

    def stream_piece(self, plan: Plan, choice: Choice, piece: ChoiceDelta) -> list[Event]:
        entry = self._chunk_choice(plan, choice, piece)
        if entry is None:
            return []
        events: list[Event] = []
        delta = entry["delta"]
        if delta.get("reasoning"):
            events += self._add_text(plan, "thinking", delta["reasoning"])
        if delta.get("content"):
            events += self._add_text(plan, "text", delta["content"])
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            block = self._open
            if "id" in call:
                block = Block("call", self._num_blocks, "", call["id"], function["name"])
                events += self._open_block(plan, block)
            if block is None:
                raise RuntimeError("a tool call's arguments came before the call")
            if function["arguments"]:
                block.text += function["arguments"]
                events += self.block_delta(plan, block, function["arguments"])
        if entry["finish_reason"] is not None:
            self.finish_reason = entry["finish_reason"]
            events += self._close_block(plan)
            events += self.message_finished(plan, choice, entry["finish_reason"])
        return events

    def _add_text(self, plan: Plan, kind: Literal["text", "thinking"], text: str) -> list[Event]:
        """The events that add ``text`` to the open block of ``kind`` (a new one is
        opened when no block, or one of another kind, is open)."""
        events: list[Event] = []
        block = self._open
        if block is None or block.kind != kind:
            block = Block(kind, self._num_blocks)
            events += self._open_block(plan, block)
        block.text += text
        return events + self.block_delta(plan, block, text)

    def _open_block(self, plan: Plan, block: Block) -> list[Event]:
        events = self._close_block(plan)
        self._open = block
        self._num_blocks += 1
        return events + self.block_started(plan, block)

    def _close_block(self, plan: Plan) -> list[Event]:
        block, self._open = self._open, None
        return [] if block is None else self.block_stopped(plan, block)

    @abstractmethod
    def block_started(self, plan: Plan, block: Block) -> list[Event]:
        """The events that open ``block`` (its text is still empty)."""

    @abstractmethod
    def block_delta(self, plan: Plan, block: Block, text: str) -> list[Event]:
        """The events that carry ``text``, the block's newest piece."""

    @abstractmethod
    def block_stopped(self, plan: Plan, block: Block) -> list[Event]:
        """The events that close ``block`` (its text is whole)."""

    @abstractmethod
    def message_finished(self, plan: Plan, choice: Choice, finish_reason: str) -> list[Event]:
        """The events after the last block, given the chat finish reason."""
