"""The `Planner`: a request in, the engine requests of its `Plan` out (no server, no engine)."""

from __future__ import annotations

import sys
from functools import partial
from types import FrameType, SimpleNamespace

import pytest
import trio

from trio_llm.api.anthropic.format import MessagesFormat
from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.format import ChatFormat, CompletionFormat
from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.planner import Planner
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.http.errors import APIError
from trio_llm.errors import ContextLengthError, InvalidRequest
from trio_llm.frontend.generation_defaults import GenerationDefaults
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.server_config import RequestLimits
from trio_llm.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "Hi"}]


def _planner(tokenizer: Tokenizer, max_model_len: int = 256, **defaults: int) -> Planner:
    return Planner(
        inputs=InputPreprocessor(tokenizer, max_model_len, 49152),
        grammar_checks=trio.CapacityLimiter(1),
        limits=RequestLimits(),
        generation_defaults=GenerationDefaults(**defaults),
        max_logprobs=5,
        tool_call_parser=None,
        reasoning_parser=None,
        disable_additional_properties=True,
    )


def test_a_batch_of_prompts_makes_n_requests_each(smol_tokenizer: Tokenizer) -> None:
    request = CompletionRequest.model_validate(
        {"prompt": ["Hello", "Hi there"], "n": 2, "seed": 10, "max_tokens": 4, "echo": True}
    )
    plan = trio.run(_planner(smol_tokenizer).plan_completion, request, "tiny")
    assert isinstance(plan.format, CompletionFormat)
    assert plan.model == "tiny"
    hello = smol_tokenizer.encode("Hello", add_special_tokens=True)
    there = smol_tokenizer.encode("Hi there", add_special_tokens=True)
    # Choice index prompt_index * n + sample, as vLLM numbers them; seeds seed + sample.
    assert [ids for ids, _ in plan.requests] == [hello, hello, there, there]
    assert [params.seed for _, params in plan.requests] == [10, 11, 10, 11]
    assert {params.max_tokens for _, params in plan.requests} == {4}
    assert plan.prompt_lengths == [len(hello), len(there)]
    assert plan.echo_texts == ["Hello", "Hello", "Hi there", "Hi there"]


def test_a_token_id_prompt_echoes_its_decoded_text(smol_tokenizer: Tokenizer) -> None:
    request = CompletionRequest.model_validate({"prompt": [5, 6, 7, 8], "echo": True})
    plan = trio.run(_planner(smol_tokenizer).plan_completion, request, "tiny")
    assert [ids for ids, _ in plan.requests] == [[5, 6, 7, 8]]
    assert plan.echo_texts == [smol_tokenizer.decode([5, 6, 7, 8], skip_special_tokens=True)]


def test_a_chat_prompt_is_the_rendered_template(smol_tokenizer: Tokenizer) -> None:
    request = ChatCompletionRequest.model_validate({"messages": CHAT})
    planner = _planner(smol_tokenizer)
    plan = trio.run(planner.plan_chat, request, "tiny")
    assert isinstance(plan.format, ChatFormat)
    text = smol_tokenizer.render_chat(CHAT)
    [(ids, params)] = plan.requests
    assert ids == smol_tokenizer.encode(text, add_special_tokens=False)
    # No max_tokens: the rest of the context.
    assert params.max_tokens == 256 - len(ids)
    # /v1/messages/count_tokens counts the same prompt.
    assert planner.count_prompt_tokens(request) == len(ids)


def test_the_server_default_and_cap_bound_the_output(smol_tokenizer: Tokenizer) -> None:
    planner = _planner(smol_tokenizer, max_tokens=7, max_tokens_cap=9)
    unset = ChatCompletionRequest.model_validate({"messages": CHAT})
    large = ChatCompletionRequest.model_validate({"messages": CHAT, "max_tokens": 50})
    assert trio.run(planner.plan_chat, unset, "m").requests[0][1].max_tokens == 7
    assert trio.run(planner.plan_chat, large, "m").requests[0][1].max_tokens == 9


def test_refusals_name_their_field(smol_tokenizer: Tokenizer) -> None:
    planner = _planner(smol_tokenizer, max_model_len=8)
    too_long = ChatCompletionRequest.model_validate({"messages": CHAT})
    with pytest.raises(ContextLengthError) as context:
        trio.run(planner.plan_chat, too_long, "m")
    assert context.value.param == "messages"
    empty = CompletionRequest.model_validate({"prompt": ["a", ""]})
    with pytest.raises(InvalidRequest, match="the prompt is empty") as refused:
        trio.run(planner.plan_completion, empty, "m")
    assert refused.value.param == "prompt"
    logprobs = CompletionRequest.model_validate({"prompt": "a", "logprobs": 6})
    with pytest.raises(APIError, match="--max-logprobs") as error:
        trio.run(planner.plan_completion, logprobs, "m")
    assert error.value.param == "logprobs"


@pytest.mark.parametrize(
    ("max_tokens", "cap", "bound", "stop_reason"),
    [
        (5, None, "request", "max_tokens"),  # the client's own limit
        (5, 3, "server", "max_tokens"),  # the operator's: the model's maximum here
        (None, 3, "server", "max_tokens"),  # no limit sent (Codex): the operator's
        (10_000, 3, "server", "max_tokens"),
        (10_000, None, "context", "model_context_window_exceeded"),  # the context is full
        (None, None, "context", "model_context_window_exceeded"),
    ],
)
def test_a_cut_answer_names_the_limit_that_cut_it(
    smol_tokenizer: Tokenizer, max_tokens: int | None, cap: int | None, bound: str, stop_reason: str
) -> None:
    """Issue 41 item 18: an answer cut at its budget says which limit cut it. Messages:
    ``max_tokens`` for the request's own limit and for the server's cap (Anthropic: "the
    requested max_tokens or the model's maximum"), ``model_context_window_exceeded`` when
    the output filled the context (Claude Code then says the context window is full
    instead of telling the user to raise CLAUDE_CODE_MAX_OUTPUT_TOKENS)."""
    planner = _planner(smol_tokenizer, max_model_len=64, max_tokens_cap=cap)
    fields = {"messages": CHAT} | ({"max_tokens": max_tokens} if max_tokens else {})
    request = ChatCompletionRequest.model_validate(fields)
    plan = trio.run(partial(planner.plan_chat, request, "m", MessagesFormat))
    assert plan.output_bounds == [bound]
    [(_ids, params)] = plan.requests
    choice = SimpleNamespace(
        index=0,
        text="cut",
        finish_reason="length",
        stop_reason=None,
        num_output_tokens=params.max_tokens,
        num_cached_tokens=0,
        all_logprobs=[],
    )
    form = plan.format
    assert form.response(plan, [choice])["stop_reason"] == stop_reason
    events = dict(form.message_finished(plan, choice, "length"))
    assert events["message_delta"]["delta"]["stop_reason"] == stop_reason


TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("template", "says", "param"),
    [
        (None, "this model has no chat template", "messages"),
        ("{{ messages[0]['content'] }}", "chat template cannot show tools", "tools"),
    ],
)
def test_tools_without_a_template_say_what_is_missing(
    smol_tokenizer: Tokenizer, template: str | None, says: str, param: str
) -> None:
    """Issue 41 item 18: a model without any chat template (Gemma 3 270M, a base model)
    is not told its template "cannot show tools": it has none."""
    tokenizer = Tokenizer(smol_tokenizer.backend, template)
    planner = _planner(tokenizer)
    planner.tool_call_parser = "hermes"
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": TOOLS})
    with pytest.raises(APIError) as error:
        trio.run(planner.plan_chat, request, "m")
    assert says in error.value.message and error.value.param == param
    if template is None:
        assert "cannot show tools" not in error.value.message


def test_a_chat_request_enters_the_prompt_layer_once(smol_tokenizer: Tokenizer) -> None:
    """Issue 43's target 5: `Planner.plan_chat` calls into `frontend/preprocess.py` once
    (`prepare_chat`), and the request stays within 6 modules outside the API."""
    request = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "n": 2, "stop_token_ids": [5], "max_tokens": 3}
    )
    entered: list[tuple[str, str]] = []
    outside: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("trio_llm."):
            return
        if not module.startswith("trio_llm.api."):
            outside.add(module)
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller.startswith("trio_llm.api.") and module == "trio_llm.frontend.preprocess":
            entered.append((caller, frame.f_code.co_name))

    planner = _planner(smol_tokenizer)

    async def plan() -> Plan:
        sys.setprofile(profile)
        try:
            return await planner.plan_chat(request, "tiny")
        finally:
            sys.setprofile(None)

    made = trio.run(plan)
    assert [params.max_tokens for _, params in made.requests] == [3, 3]  # it was planned
    assert entered == [("trio_llm.api.chat.planner", "prepare_chat")]
    assert "trio_llm.text.tokenizer" in outside and len(outside) <= 6, sorted(outside)


def test_a_cache_salt_reaches_every_engine_request(smol_tokenizer: Tokenizer) -> None:
    request = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "n": 2, "cache_salt": "tenant-a"}
    )
    plan = trio.run(_planner(smol_tokenizer).plan_chat, request, "tiny")
    assert [params.cache_salt for _, params in plan.requests] == ["tenant-a", "tenant-a"]
    unsalted = ChatCompletionRequest.model_validate({"messages": CHAT})
    plan = trio.run(_planner(smol_tokenizer).plan_chat, unsalted, "tiny")
    assert plan.requests[0][1].cache_salt is None
    with pytest.raises(ValueError, match="cache_salt"):
        ChatCompletionRequest.model_validate({"messages": CHAT, "cache_salt": ""})
