"""What one API request will run: the `Planner` that builds its `Plan`.

`Planner.plan_completion` and `Planner.plan_chat` check a request, hand its whole prompt
to the `InputPreprocessor` (rendered, tokenized, checked against the context), fit the
output budget (with the server's generation defaults) and make one `SamplingParams` per
choice: each prompt of a batch, ``n`` times (`trio_llm.api.chat.plan.Plan`). They
choose the output format too: what reads tool calls and reasoning out of a chat choice.
`trio_llm.api.chat.run_choices` then runs the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import msgspec
import trio

from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.format import ChatFormat, CompletionFormat
from trio_llm.api.chat.generation_request import GenerationRequest
from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.translated import ChatTranslated
from trio_llm.api.http.errors import bad_request
from trio_llm.api.tools.calls import NamedCallParser, ToolCallParser
from trio_llm.api.tools.parsers import make_parser, required_parser
from trio_llm.frontend.chat_prompt import ChatChoices, ChatPrompt, OutputBudget, RequestTemplate
from trio_llm.frontend.generation_defaults import GenerationDefaults
from trio_llm.frontend.preprocess import InputPreprocessor, fan_out
from trio_llm.messages import SamplingParams, Scheduling
from trio_llm.server_config import RequestLimits
from trio_llm.text.reasoning import ReasoningFormat, reasoning_format
from trio_llm.text.stop import compile_stops
from trio_llm.text.tokenizer import Tokenizer

#: Stop strings with more characters than this in all are compiled in a worker thread.
INLINE_STOP_CHARS = 1024

#: Output constraints of at most this many characters of spec have their grammars
#: checked at once (a few milliseconds); larger ones queue for `Planner.grammar_checks`.
SMALL_GRAMMAR_CHARS = 16 * 1024


def to_chat_prompt(
    request: ChatCompletionRequest,
    special_tokens: Iterable[str],
    request_template: RequestTemplate | None = None,
) -> ChatPrompt:
    """What the chat template (the model's, or the request's own ``request_template``
    once `Planner.request_template` allowed it) renders for ``request``
    (``special_tokens``: the tokenizer's, which ``chat_template_kwargs`` may not set).

    Raises:
        APIError: ``chat_template_kwargs`` sets a variable the server sets itself.
    """
    template_kwargs = request.template_kwargs(special_tokens)
    return ChatPrompt(
        request.template_messages(),
        request.template_tools(),
        continue_final_message=request.continue_final_message,
        template_kwargs=template_kwargs,
        fold_late_system=request.translated.fold_late_system,
        request_template=request_template,
    )


@dataclass(kw_only=True, eq=False)
class Planner:
    """Builds the `Plan` of a completion or chat request for one model.

    Attributes:
        inputs: the model's preprocessor (tokenizer, context length, vocabulary).
        grammar_checks: how many large structured-output specs are checked at once
            (each in a worker thread, building a grammar).
        scheduling_policy: the engine's (`EngineReady.scheduling_policy`): a nonzero
            ``priority`` is refused unless it is ``priority``.
        The others: as `ModelServing`'s arguments of the same names.
    """

    inputs: InputPreprocessor
    grammar_checks: trio.CapacityLimiter
    limits: RequestLimits
    generation_defaults: GenerationDefaults
    max_logprobs: int
    tool_call_parser: str | None
    reasoning_parser: str | None
    disable_additional_properties: bool
    scheduling_policy: str = "fcfs"
    trust_request_chat_template: bool = False

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (with chat template)."""
        return self.inputs.tokenizer

    @property
    def vocab_size(self) -> int:
        """The number of token ids (valid ids are ``0 .. vocab_size - 1``)."""
        return self.inputs.vocab_size

    # ------------------------------------------------------------ completions

    async def plan_completion(self, request: CompletionRequest, model: str) -> Plan:
        """Check and tokenize a completion request into a `Plan` answered as ``model``.

        Raises:
            APIError: a 400 naming the field at fault.
            InvalidRequest: a prompt the preprocessor refuses (empty, too long, ...).
        """
        scheduling = await self._check_common(request)
        if request.suffix:
            raise bad_request("`suffix` (insertion) is not supported by this model", "suffix")
        self._check_logprobs(request.logprobs, "logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request(
                "prompt_logprobs is served in non-streamed responses only", "prompt_logprobs"
            )
        if request.max_tokens == 0 and not request.echo:
            raise bad_request(
                "max_tokens must be at least 1 (0 is only allowed with echo=true)", "max_tokens"
            )
        prompts = await self.inputs.completion_prompts(request.prompt)
        if len(prompts) * request.n > self.limits.max_choices:
            raise bad_request(
                f"{len(prompts)} prompts x n={request.n} is more than this server's limit of "
                f"{self.limits.max_choices} choices per request (--max-choices)",
                "n",
            )
        wanted = [request.logprobs if request.echo else None, request.prompt_logprobs]
        counts = [count for count in wanted if count is not None]
        plan = Plan(CompletionFormat(self.tokenizer), model, echo=request.echo)
        plan.scheduling = scheduling
        plan.num_top_logprobs = request.logprobs
        plan.num_prompt_logprobs = request.prompt_logprobs
        plan.structured_param = request.structured_param
        for prompt in prompts:
            budget = self._max_tokens(request.max_tokens, len(prompt.token_ids), "max_tokens")
            params = self._params(
                request,
                budget.tokens,
                logprobs=request.logprobs,
                prompt_logprobs=max(counts) if counts else None,
            )
            echo_text = prompt.text
            if request.echo and echo_text is None:
                echo_text = self.tokenizer.decode(
                    prompt.token_ids, skip_special_tokens=request.skip_special_tokens
                )
            plan.add_prompt(prompt.token_ids, params, echo_text, budget.bound)
        return plan

    # ------------------------------------------------------------ chat

    async def plan_chat(
        self,
        request: ChatCompletionRequest,
        model: str,
        make_format: Callable[..., ChatFormat] = ChatFormat,
        *,
        count_only: bool = False,
    ) -> Plan:
        """Check, render and tokenize a chat request into a `Plan` answered as ``model``
        in the format ``make_format`` makes (`ChatFormat`'s arguments).

        Args:
            count_only: only its prompt is wanted (``/v1/messages/count_tokens``): a
                prompt of any length, over the context too, is counted, not refused.

        Raises:
            APIError: a 400 naming the field at fault.
            InvalidRequest: a message or tool the template or tokenizer refuses.
        """
        scheduling = await self._check_common(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self._check_logprobs(request.top_logprobs, "top_logprobs")
        own_template = self.request_template(request.request_chat_template)
        tool_parser = self._tool_parser(request, own_template is not None)
        if request.continue_final_message and request.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs a final assistant message to continue",
                "continue_final_message",
            )
        chat = to_chat_prompt(request, self.tokenizer.special_tokens, own_template)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        choices = self._chat_choices(request, logprobs, count_only)
        prepared = await self.inputs.prepare_chat(chat, choices)  # the one crossing
        reasoning = None
        if self.reasoning_parser is not None:
            text = prepared.prompt.text or ""  # a chat prompt always has its rendered text
            reasoning = reasoning_format(self.reasoning_parser, text, chat.template_kwargs)
        chat_format = make_format(
            self.tokenizer,
            tool_parser,
            parallel_tool_calls=request.parallel_tool_calls,
            reasoning_parser=reasoning.parser if reasoning is not None else None,
        )
        plan = Plan(chat_format, model, num_top_logprobs=logprobs, scheduling=scheduling)
        plan.structured_param = request.structured_param
        params = [params for _, params in prepared.requests]
        if reasoning is not None:
            params = [self._after_reasoning(p, reasoning) for p in params]
        plan.add_prompt(prepared.prompt.token_ids, params, None, prepared.budget.bound)
        return plan

    def _chat_choices(
        self, request: ChatCompletionRequest, logprobs: int | None, count_only: bool
    ) -> ChatChoices:
        """What ``request`` asks of its choices, for `InputPreprocessor.prepare_chat`."""
        defaults = self.generation_defaults
        return ChatChoices(
            n=request.n,
            sampling=partial(self._sampling, request, logprobs=logprobs),
            max_tokens=request.max_completion_tokens or request.max_tokens,
            max_tokens_param=(
                "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            ),
            default_max_tokens=defaults.max_tokens,
            max_tokens_cap=defaults.max_tokens_cap,
            stop_token_ids=request.stop_token_ids,
            count_only=count_only,
        )

    def count_prompt_tokens(self, request: ChatCompletionRequest) -> int:
        """The prompt tokens of a chat request, rendered as `plan_chat` renders it
        (whatever its length: no context check). Runs in a worker thread (`to_chat`).

        Raises:
            InvalidRequest: the chat template rejects the messages.
        """
        chat = to_chat_prompt(request, self.tokenizer.special_tokens)
        return self.inputs.count_chat_tokens(chat)

    def map_thinking_switch(self, request: ChatTranslated, chat: ChatCompletionRequest) -> None:
        """Set ``enable_thinking`` in ``chat``'s template variables from the translated
        request's own reasoning switch (`ChatTranslated.thinking_requested`: Anthropic's
        ``thinking``, the Responses API's ``reasoning.effort``), where the chat template
        has that switch (Qwen3's) and ``chat_template_kwargs`` do not set it already."""
        wanted = request.thinking_requested()
        template = self.tokenizer.chat_template or ""
        if wanted is None or "enable_thinking" not in template:
            return
        kwargs = dict(chat.chat_template_kwargs or {})
        kwargs.setdefault("enable_thinking", wanted)
        chat.chat_template_kwargs = kwargs

    def request_template(self, source: str | None) -> RequestTemplate | None:
        """A request's own chat template (``source``; None: it brings none), as allowed.

        Raises:
            APIError: a 400 naming ``chat_template``: the server does not trust request
                templates (``--trust-request-chat-template``), or it is too long.
        """
        if source is None:
            return None
        if not self.trust_request_chat_template:
            raise bad_request(
                "this server does not use a chat_template sent with a request: leave it "
                "out (the model's template is used), or start the server with "
                "--trust-request-chat-template",
                "chat_template",
            )
        limit = self.limits.max_request_chat_template_bytes
        if len(source.encode("utf-8", "surrogatepass")) > limit:
            raise bad_request(
                f"chat_template is longer than this server's limit of {limit} bytes "
                "(--max-request-chat-template-bytes)",
                "chat_template",
            )
        return RequestTemplate(source, self.limits.request_chat_template_timeout)

    def _tool_parser(
        self, request: ChatCompletionRequest, own_template: bool = False
    ) -> Callable[[], ToolCallParser] | None:
        """What reads tool calls out of each choice's text (None: plain text);
        ``own_template``: the request brings the template that shows its tools.

        Raises:
            APIError: ``tool_choice: "auto"`` on a server without a parser, or with a
                model without a chat template or whose template cannot show the tools
                (400s naming the field).
        """
        choice = request.effective_tool_choice
        if choice == "none":
            return None
        if choice == "required":
            return required_parser
        if request.forced_function is not None:
            return partial(NamedCallParser, request.forced_function)
        if self.tool_call_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default when tools are given) needs a server '
                "started with --enable-auto-tool-choice --tool-call-parser NAME; or send "
                'tool_choice "required", "none" or a named function',
                "tool_choice",
            )
        # A request's own template shows its tools, or not: the client's choice.
        if not own_template and not self.tokenizer.chat_template:
            raise bad_request(
                "this model has no chat template, so a chat request cannot be shown to it "
                "(nor its tools); start the server with --chat-template naming a template "
                "that shows tools, or send a plain prompt to /v1/completions",
                "messages",
            )
        if not own_template and self.tokenizer.tool_template is None:
            raise bad_request(
                "this model's chat template cannot show tools to the model; start the "
                "server with a tool-aware --chat-template",
                "tools",
            )
        if request.held_calls_or_answer:  # calls, or an answer held to the format
            names = frozenset(tool.function.name for tool in request.tools or ())
            return partial(make_parser, self.tool_call_parser, names=names, held=True)
        return partial(make_parser, self.tool_call_parser)

    def _after_reasoning(
        self, params: SamplingParams, reasoning: ReasoningFormat
    ) -> SamplingParams:
        """``params`` with its output constraint (if any) applied after the reasoning part
        of the output, as vLLM applies ``structured_outputs`` with a reasoning parser."""
        constraint = params.structured_output
        if constraint is None:
            return params
        prefix = reasoning.grammar(self.tokenizer.added_token_id)
        if prefix is None:
            return params
        constraint = msgspec.structs.replace(constraint, prefix=prefix)
        return msgspec.structs.replace(params, structured_output=constraint)

    # ------------------------------------------------------------ both

    def _check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.max_logprobs:
            raise bad_request(
                f"{param}={value} is more than this server's limit of {self.max_logprobs} "
                "(--max-logprobs)",
                param,
            )

    async def _check_common(self, request: GenerationRequest) -> Scheduling:
        """Check what completions and chat share; returns the engine requests'
        `Scheduling` (a 400 naming ``priority`` for one the engine does not serve)."""
        scheduling = request.scheduling(request.priority, self.scheduling_policy)
        request.set_server_options(
            tool_call_parser=self.tool_call_parser,
            disable_additional_properties=self.disable_additional_properties,
        )
        request.check_supported()
        if request.stop_token_ids and not isinstance(request, ChatCompletionRequest):
            # (A chat request's are checked with its prompt: `InputPreprocessor.prepare_chat`.)
            self.inputs.check_token_ids(request.stop_token_ids, "stop_token_ids")
        stops = request.stop_strings
        if sum(map(len, stops)) > INLINE_STOP_CHARS:
            # Build the automaton off the loop; the choices then find it in the cache.
            await trio.to_thread.run_sync(compile_stops, tuple(dict.fromkeys(stops)))
        if request.asks_for_structured_output:
            # Parse and check the spec off the loop; `_params` then finds the result.
            # First its size limits (cheap), then its grammar: a large one waits its turn
            # among at most `grammar_checks` at once, so a small one never waits behind
            # hostile ones. A check whose client leaves is abandoned (its thread ends by
            # itself, bounded by the limits and llguidance's own).
            chars = await trio.to_thread.run_sync(
                request.structured_output_chars, abandon_on_cancel=True
            )
            limiter = self.grammar_checks if chars > SMALL_GRAMMAR_CHARS else None
            await trio.to_thread.run_sync(
                request.structured_output, limiter=limiter, abandon_on_cancel=True
            )
        return scheduling

    def _max_tokens(
        self, requested: int | None, num_prompt: int, param: str, prompt_param: str = "prompt"
    ) -> OutputBudget:
        """The output budget of one prompt (`InputPreprocessor.output_budget`, with the
        server's generation defaults).

        Raises:
            ContextLengthError: the prompt (or, strict, the output asked for) does not fit.
        """
        defaults = self.generation_defaults
        if requested == 0:  # echo only: no output, whatever the server's defaults
            return self.inputs.output_budget(0, num_prompt, param, prompt_param)
        return self.inputs.output_budget(
            requested,
            num_prompt,
            param,
            prompt_param,
            default=defaults.max_tokens,
            cap=defaults.max_tokens_cap,
        )

    def _params(
        self,
        request: GenerationRequest,
        max_tokens: int,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> list[SamplingParams]:
        """One `SamplingParams` per sample (``n``), seeds ``seed + i``."""
        base = self._sampling(
            request, max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )
        return fan_out(base, request.n)

    def _sampling(
        self,
        request: GenerationRequest,
        max_tokens: int,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The `SamplingParams` of the request's first sample, with ``max_tokens``.

        Raises:
            APIError: a ``min_tokens`` above ``max_tokens``, or parameters the engine
                refuses (400s).
        """
        if max_tokens and request.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens={request.min_tokens} is more than the {max_tokens} output tokens "
                "allowed",
                "min_tokens",
            )
        vocab_size = self.vocab_size
        base = request.sampling_params(
            max_tokens,
            vocab_size,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            defaults=self.generation_defaults.sampling,
        )
        try:
            base.validate(vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        return base
