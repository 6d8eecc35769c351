"""Issue 31, items 5, 6 and 8 and the max_tokens clamp, through the real HTTP app with the
engine played by the test (a 256-token context):

- a prompt over the context is refused on every route in the words its clients check:
  OpenAI's / vLLM's "This model's maximum context length is N tokens" with code
  ``context_length_exceeded`` (LiteLLM's own mapping gives ContextWindowExceededError;
  a streamed Responses request fails with ``response.failed``, where Codex looks), and
  Anthropic's "prompt is too long: N tokens > M maximum" on /v1/messages (Claude Code's
  own pattern parses it);
- a max_tokens past the room left is clamped (finish_reason "length", stop_reason
  "model_context_window_exceeded"), or refused under ``--max-tokens-policy strict``;
- the engine's per-request prefix-cache hits reach each API's usage;
- ``--generation-config`` / ``--override-generation-config`` defaults, as vLLM applies them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.asgi import json_post_scope
from tests.support.sse import named_events
from tests.unit.conftest import INFO, STATS, FakeEngine, app_client, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine.core import EngineCore
from trio_llm.messages import AddRequest, RequestOutput, SamplingParams, StepOutputs

CONTEXT = INFO.max_model_len  # 256 tokens
LONG = "word " * 300  # about 300 tokens: over the context
OPENAI_HEAD = re.compile(
    rf"^This model's maximum context length is {CONTEXT} tokens\. However, your request has "
    r"(\d+) input tokens\. Please reduce the length of the (messages|prompt|input)\.$"
)
#: Claude Code 2.1's own checks (its cli bundle): "prompt is too long" on a 400, the token
#: counts read with this pattern; and the one it lowers max_tokens by.
CLAUDE_CODE_TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
CLAUDE_CODE_MAX_TOKENS = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


class ScriptedEngine(FakeEngine):
    """Answers each request with all of its ``max_tokens`` at once (finish "length"),
    reporting ``num_cached`` prompt tokens from the prefix cache on that first output."""

    def __init__(self, stream: trio.abc.Stream, num_cached: int = 0) -> None:
        super().__init__(stream)
        self.num_cached = num_cached
        self.params: list[SamplingParams] = []

    async def on_message(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self.params.append(message.params)
            output = RequestOutput(
                message.request_id,
                [28] * message.params.max_tokens,
                "length",
                num_cached_tokens=self.num_cached,
            )
            await self.server_side.send(StepOutputs([output], STATS))


async def _post(
    smol_tokenizer, requests: list[tuple[str, dict[str, Any]]], num_cached: int = 0, **serving
) -> tuple[list[httpx.Response], ScriptedEngine]:
    """Each ``(path, body)`` posted in turn to the app around a `ScriptedEngine`."""
    engine = partial(ScriptedEngine, num_cached=num_cached)
    async with app_client(smol_tokenizer, engine, **serving) as (client, fake):
        responses = [await client.post(path, json=body) for path, body in requests]
    return responses, fake  # type: ignore[return-value]


def _chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def _message(content: str = "hi", max_tokens: int = 5, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens, **_chat(content), **fields}


# ---------------------------------------------------------------- overflow errors


OPENAI_OVERFLOWS = [
    ("/v1/completions", {"model": "m", "prompt": LONG}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": list(range(300))}, "prompt"),
    ("/v1/chat/completions", _chat(LONG), "messages"),
    ("/v1/responses", {"model": "m", "input": LONG}, "input"),
]


@pytest.mark.parametrize(("path", "body", "param"), OPENAI_OVERFLOWS)
async def test_openai_routes_refuse_an_overflow_in_openai_words(
    smol_tokenizer, path: str, body: dict[str, Any], param: str
) -> None:
    (response,), _ = await _post(smol_tokenizer, [(path, body)])
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )
    match = OPENAI_HEAD.match(error["message"])
    assert match, error["message"]
    if path == "/v1/completions":
        prompt = body["prompt"]
        tokens = prompt if isinstance(prompt, list) else smol_tokenizer.encode(prompt)
        assert int(match.group(1)) == len(tokens)
    assert int(match.group(1)) > CONTEXT


async def test_litellm_maps_each_overflow_to_context_window_exceeded(smol_tokenizer) -> None:
    """LiteLLM's own mapping (``exception_type``, what aider and the LiteLLM proxy run)
    applied to the errors as the openai SDK and LiteLLM's Anthropic client raise them."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list download
    litellm = pytest.importorskip("litellm")
    openai = pytest.importorskip("openai")
    from litellm.llms.anthropic.common_utils import AnthropicError

    requests = [(path, body) for path, body, _ in OPENAI_OVERFLOWS]
    responses, _ = await _post(smol_tokenizer, [*requests, ("/v1/messages", _message(LONG))])
    sdk = openai.OpenAI(api_key="unused", base_url="http://test/v1")
    litellm.suppress_debug_info = True
    for (path, _), response in zip(requests, responses[:-1], strict=True):
        error = sdk._make_status_error_from_response(response)
        assert isinstance(error, openai.BadRequestError)
        for provider in ("openai", "hosted_vllm"):
            mapped = _litellm_mapping(litellm, error, provider)
            assert isinstance(mapped, litellm.ContextWindowExceededError), (path, provider)
    anthropic_error = AnthropicError(status_code=400, message=responses[-1].text)
    mapped = _litellm_mapping(litellm, anthropic_error, "anthropic")
    assert isinstance(mapped, litellm.ContextWindowExceededError)


def _litellm_mapping(litellm: Any, error: Exception, provider: str) -> Exception:
    """The exception LiteLLM's ``exception_type`` raises for ``error`` from ``provider``."""
    try:
        litellm.exception_type(model="m", original_exception=error, custom_llm_provider=provider)
    except Exception as mapped:
        return mapped
    raise AssertionError("exception_type raised nothing")


async def test_messages_refuses_an_overflow_in_anthropic_words(smol_tokenizer) -> None:
    (chat, message, count_free), _ = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat(LONG)),
            ("/v1/messages", _message(LONG)),
            ("/v1/messages", _message("x" * 100_000)),  # refused before tokenizing
        ],
    )
    num_tokens = int(OPENAI_HEAD.match(chat.json()["error"]["message"]).group(1))
    assert message.status_code == 400
    body = message.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    # The longest prompt is one token short of the context (one must remain for output).
    assert body["error"]["message"] == f"prompt is too long: {num_tokens} tokens > 255 maximum"
    actual, limit = map(int, CLAUDE_CODE_TOO_LONG.search(message.text).groups())
    assert (actual, limit) == (num_tokens, CONTEXT - 1)
    # A text far over the context: a lower bound on its tokens, still over the maximum.
    actual, limit = map(int, CLAUDE_CODE_TOO_LONG.search(count_free.text).groups())
    assert count_free.json()["error"]["message"].startswith("prompt is too long: at least ")
    assert actual > limit == CONTEXT - 1


async def test_a_streamed_responses_overflow_fails_as_codex_reads_it(smol_tokenizer) -> None:
    """Codex takes a full context window from ``response.failed`` with the error code
    ``context_length_exceeded`` (codex-rs sse/responses.rs), not from an HTTP 400."""
    body = {"model": "m", "input": LONG, "stream": True}
    (response,), fake = await _post(smol_tokenizer, [("/v1/responses", body)])
    assert response.status_code == 200
    events = named_events(response.text)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "context_length_exceeded"
    assert OPENAI_HEAD.match(failed["error"]["message"])
    assert fake.params == []  # nothing reached the engine


# ---------------------------------------------------------------- the max_tokens clamp


async def test_max_tokens_past_the_context_is_clamped_and_ends_with_length(
    smol_tokenizer,
) -> None:
    prompt = smol_tokenizer.encode("hi there", add_special_tokens=True)
    responses, fake = await _post(
        smol_tokenizer,
        [
            ("/v1/completions", {"model": "m", "prompt": "hi there", "max_tokens": 32000}),
            ("/v1/chat/completions", _chat(max_tokens=32000)),
            ("/v1/chat/completions", _chat(max_completion_tokens=32000)),
            ("/v1/messages", _message(max_tokens=32000)),  # what Claude Code sends
            ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 32000}),
        ],
    )
    assert [r.status_code for r in responses] == [200] * 5
    completion, chat, chat2, message, response = (r.json() for r in responses)
    assert fake.params[0].max_tokens == CONTEXT - len(prompt)
    chat_prompt = chat["usage"]["prompt_tokens"]
    assert [p.max_tokens for p in fake.params[1:]] == [CONTEXT - chat_prompt] * 4
    assert completion["choices"][0]["finish_reason"] == "length"
    assert chat["choices"][0]["finish_reason"] == chat2["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == CONTEXT - chat_prompt
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert response["status"] == "incomplete"


async def test_strict_policy_refuses_max_tokens_past_the_context(smol_tokenizer) -> None:
    responses, fake = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat(max_tokens=32000)),
            ("/v1/messages", _message(max_tokens=32000)),
            ("/v1/chat/completions", _chat(max_tokens=10)),  # fits: served
        ],
        max_tokens_policy="strict",
    )
    chat, message, fits = responses
    assert (chat.status_code, message.status_code, fits.status_code) == (400, 400, 200)
    num_prompt = fits.json()["usage"]["prompt_tokens"]
    error = chat.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{num_prompt + 32000} tokens ({num_prompt} in the messages, 32000 in the "
        "completion). Please reduce the length of the messages or completion."
    )
    parsed = CLAUDE_CODE_MAX_TOKENS.search(message.json()["error"]["message"])
    assert tuple(map(int, parsed.groups())) == (num_prompt, 32000, CONTEXT)
    assert [p.max_tokens for p in fake.params] == [10]


# ---------------------------------------------------------------- prefix-cache hits


async def test_prefix_cache_hits_reach_every_usage(smol_tokenizer) -> None:
    stream_options = {"stream": True, "stream_options": {"include_usage": True}}
    responses, _ = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat(max_tokens=3)),
            ("/v1/completions", {"model": "m", "prompt": "hi there", "max_tokens": 3}),
            ("/v1/chat/completions", _chat(max_tokens=3, **stream_options)),
            ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3}),
            ("/v1/messages", _message(max_tokens=3)),
            ("/v1/messages", _message(max_tokens=3, stream=True)),
        ],
        num_cached=4,
    )
    chat, completion, streamed, response, message, streamed_message = responses
    assert chat.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert completion.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    last_chunk = named_events(streamed.text)[-2][1]
    assert last_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    usage = response.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == 4
    prompt = chat.json()["usage"]["prompt_tokens"]
    # Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens = prompt.
    usage = message.json()["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (prompt - 4, 4)
    assert usage["cache_creation_input_tokens"] == 0
    name, start = named_events(streamed_message.text)[0]
    assert name == "message_start"
    assert start["message"]["usage"]["cache_read_input_tokens"] == 4
    assert start["message"]["usage"]["input_tokens"] == prompt - 4


def _core() -> EngineCore:
    from tests.support.tiny_model import build_tiny_model
    from trio_llm.engine.attention import ATTENTION_NAME

    model = build_tiny_model(seed=0)
    model.set_attn_implementation(ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    return EngineCore(model, config, "tiny")


def test_the_engine_reports_each_requests_cached_prefix_once() -> None:
    core = _core()
    shared = list(range(100, 137))  # 37 tokens: 9 full blocks of 4
    params = SamplingParams(max_tokens=6, temperature=0)
    outputs: dict[str, list[RequestOutput]] = {}

    def run() -> None:
        while core.has_unfinished_requests():
            for output in core.step().outputs:
                outputs.setdefault(output.request_id, []).append(output)

    core.add_request(AddRequest("a", shared, params))
    run()
    core.add_request(AddRequest("b", [*shared, 11, 12], params))
    for output in core.step().outputs:  # b is admitted with a's 9 blocks and prefilled
        outputs.setdefault(output.request_id, []).append(output)
    core.pause(["b"])  # preempted: recomputed (with more of itself cached) when resumed
    core.resume(["b"])
    run()
    reported = {rid: [o.num_cached_tokens for o in outs] for rid, outs in outputs.items()}
    assert reported["a"][0] == 0
    assert reported["b"][0] == 36
    assert all(count is None for outs in reported.values() for count in outs[1:])


# ---------------------------------------------------------------- generation defaults


def _folder(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_generation_config_modes_follow_vllm(tmp_path: Path) -> None:
    from trio_llm.frontend.generation_defaults import GenerationDefaults, load_generation_defaults

    model = _folder(
        tmp_path,
        "model",
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 20, "eos": 2},
    )
    other = _folder(tmp_path, "other", {"top_k": 40, "max_new_tokens": 12})
    auto = load_generation_defaults("auto", model)
    assert auto == GenerationDefaults({"temperature": 0.6, "top_p": 0.9}, 20, None)
    assert load_generation_defaults("vllm", model) == GenerationDefaults()
    # An explicit folder's max_new_tokens caps every request.
    assert load_generation_defaults(str(other), model) == GenerationDefaults({"top_k": 40}, 12, 12)
    # Overrides are laid over the file; their max_new_tokens is a cap in any mode.
    both = load_generation_defaults("auto", model, {"temperature": 0.2, "max_new_tokens": 8})
    assert both == GenerationDefaults({"temperature": 0.2, "top_p": 0.9}, 8, 8)
    assert load_generation_defaults("auto", tmp_path) == GenerationDefaults()  # no file
    with pytest.raises(ValueError, match="max_new_tokens"):
        load_generation_defaults("vllm", model, {"max_new_tokens": 0})


async def test_generation_defaults_fill_only_the_fields_a_request_leaves_unset(
    smol_tokenizer,
) -> None:
    from trio_llm.frontend.generation_defaults import GenerationDefaults

    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 40}, max_tokens=20)
    responses, fake = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat()),
            ("/v1/chat/completions", _chat(temperature=0, max_tokens=50, top_k=3)),
            ("/v1/messages", _message(max_tokens=7)),
        ],
        generation_defaults=defaults,
    )
    assert [r.status_code for r in responses] == [200] * 3
    unset, given, message = fake.params
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_tokens) == (0.6, 40, 1.0, 20)
    assert (given.temperature, given.top_k, given.max_tokens) == (0, 3, 50)
    assert (message.temperature, message.max_tokens) == (0.6, 7)


async def test_an_override_max_new_tokens_caps_every_request(smol_tokenizer) -> None:
    from trio_llm.frontend.generation_defaults import GenerationDefaults

    defaults = GenerationDefaults(max_tokens=8, max_tokens_cap=8)
    responses, fake = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat()),
            ("/v1/chat/completions", _chat(max_tokens=100)),
            ("/v1/chat/completions", _chat(max_tokens=5)),
        ],
        generation_defaults=defaults,
    )
    assert [p.max_tokens for p in fake.params] == [8, 8, 5]
    assert responses[1].json()["choices"][0]["finish_reason"] == "length"


class SlowPrefillEngine(FakeEngine):
    """Tells each request's first scheduling at once (no tokens yet, ``num_cached``
    prompt tokens from the cache), as the engine core does, then takes ``prefill_seconds``
    (the test's clock) before its tokens."""

    def __init__(self, stream: trio.abc.Stream, num_cached: int, prefill_seconds: float) -> None:
        super().__init__(stream)
        self.num_cached = num_cached
        self.prefill_seconds = prefill_seconds
        self.done_at = 0.0  # when the prefill ended (the test's clock)

    async def on_message(self, message: object) -> None:
        if isinstance(message, AddRequest):
            started = RequestOutput(message.request_id, [], num_cached_tokens=self.num_cached)
            await self.server_side.send(StepOutputs([started], STATS))
            await trio.sleep(self.prefill_seconds)
            self.done_at = trio.current_time()
            done = RequestOutput(message.request_id, [28] * message.params.max_tokens, "length")
            await self.server_side.send(StepOutputs([done], STATS))


async def test_a_long_prefill_opens_the_messages_stream_at_once_and_pings(
    smol_tokenizer, autojump_clock: trio.abc.Clock
) -> None:
    """message_start (with the cache hits) goes out when the engine first schedules the
    request, and pings keep the stream alive while the prefill takes minutes (Claude
    Code gives up on a stream silent for 300 s). The ASGI app is called directly: each
    body piece is timed as it is sent."""
    from trio_llm.api.chat.streaming import KEEPALIVE_SECONDS

    prefill = 10 * KEEPALIVE_SECONDS
    body = json.dumps(_message(max_tokens=3, stream=True)).encode()
    arrivals: list[tuple[float, str, Any]] = []
    sent_body = trio.Event()

    async def receive() -> dict[str, Any]:
        if not sent_body.is_set():
            sent_body.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body" or not message.get("body"):
            return
        text = message["body"].decode()
        for event in text.strip().split("\n\n"):
            name, data = event.split("\n", 1)
            arrivals.append((trio.current_time(), name[7:], json.loads(data[6:])))

    scope = json_post_scope("/v1/messages")
    async with trio.open_nursery() as nursery:
        engine, stream = engine_client_pair()
        fake = SlowPrefillEngine(stream, num_cached=4, prefill_seconds=prefill)
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        app = build_app(ModelServing(engine, smol_tokenizer, ("m",)), lambda: True)
        await app(scope, receive, send)
        nursery.cancel_scope.cancel()
    names = [name for _, name, _ in arrivals]
    # (Times are the test's clock, which jumps while worker threads render the prompt:
    # compared with the engine's own, not with the start.)
    assert names[0] == "message_start"
    assert arrivals[0][0] <= fake.done_at - prefill + 1  # as soon as the engine started
    assert arrivals[0][2]["message"]["usage"]["cache_read_input_tokens"] == 4
    times = [at for at, _, _ in arrivals]
    assert max(b - a for a, b in itertools.pairwise(times)) <= KEEPALIVE_SECONDS + 1
    assert names.count("ping") >= prefill // KEEPALIVE_SECONDS - 1
    assert names[-2:] == ["message_delta", "message_stop"]
