"""Reasoning models (``--reasoning-parser``): the parsers on vLLM's documented shapes and
on tags split across pieces; the reasoning in each API's own shape (chat's
``reasoning`` / ``reasoning_content``, Responses reasoning items, Messages thinking
blocks), streamed and whole alike; ``chat_template_kwargs`` reaching the template; and
output constraints held only after ``</think>``.

The model is a Qwen3-like one made here: SmolLM2's tokenizer with ``<think>`` and
``</think>`` added as tokens, and a small chat template with Qwen3's ``enable_thinking``
switch. Its outputs are scripted (a fake engine core sends the tokens of a given text).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import trio
from tokenizers import AddedToken
from tokenizers import Tokenizer as FastTokenizer

from tests.support.sse import named_events
from tests.unit.conftest import ScriptedEngine, engine_client_pair
from trio_llm.api.app import build_app
from trio_llm.api.chat.serving import ModelServing
from trio_llm.engine.grammar_compiler import GrammarCompiler
from trio_llm.messages import AddRequest, EngineReady
from trio_llm.text.reasoning import reasoning_format
from trio_llm.text.tokenizer import Tokenizer

#: A Qwen3-like chat template: ChatML, tools in the system turn, and Qwen3's switch.
QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

#: The token ids the tags get (appended to SmolLM2's 49,152).
THINK, END_THINK = 49152, 49153
VOCAB_SIZE = 49154
EOS = 2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """The Qwen3-like tokenizer folder (tokenizer.json, tokenizer_config.json, template)."""
    folder = tmp_path_factory.mktemp("qwen3-like")
    backend = FastTokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    tags = [AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")]
    backend.add_tokens(tags)
    assert backend.token_to_id("<think>") == THINK and backend.token_to_id("</think>") == END_THINK
    backend.save(str(folder / "tokenizer.json"))
    shutil.copy(real_model_dir / "tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_dir: Path) -> Tokenizer:
    return Tokenizer.load(qwen3_dir)


# ---------------------------------------------------------------- the parsers


def _parse(name: str, prompt: str, text: str, kwargs: dict[str, Any] | None = None):
    split = reasoning_format(name, prompt, kwargs).parser().parse(text)
    return split.reasoning or None, split.content or None


#: ``(parser, end of the prompt, chat_template_kwargs, output, reasoning, content)``, as
#: vLLM's docs and parsers read them.
A, OPENED, CLOSED = "assistant\n", "assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n"
T, OFF = "<think>Hm.</think>4", {"enable_thinking": False}
SHAPES = [
    # deepseek_r1: everything before </think> is reasoning, even without an opening tag.
    ("deepseek_r1", A, None, "<think>\nHm.\n</think>\n\nIt is 4.", "\nHm.\n", "\n\nIt is 4."),
    ("deepseek_r1", A, None, "Hm.</think>It is 4.", "Hm.", "It is 4."),
    ("deepseek_r1", A, None, "Hm, cut off", "Hm, cut off", None),
    ("deepseek_r1", OPENED, None, "Hm.</think>4", "Hm.", "4"),
    # qwen3: reasoning only between an opening <think> and </think>.
    ("qwen3", A, None, "<think>\nHm.\n</think>\n\nIt is 4.", "\nHm.\n", "\n\nIt is 4."),
    ("qwen3", A, None, "It is 4.", None, "It is 4."),
    ("qwen3", A, None, "Hm.</think>It is 4.", None, "Hm.</think>It is 4."),
    ("qwen3", A, None, "<think>\nHm, cut off", "\nHm, cut off", None),
    ("qwen3", A, {"enable_thinking": True}, T, "Hm.", "4"),
    # enable_thinking false: no reasoning (the template closed it in the prompt).
    ("qwen3", A, OFF, T, None, T),
    ("qwen3", CLOSED, None, T, None, T),
    ("deepseek_r1", CLOSED, None, "Hm.</think>4", None, "Hm.</think>4"),
    # a template that opens the reasoning (Qwen3's thinking-only ones)
    ("qwen3", OPENED, None, "Hm.</think>4", "Hm.", "4"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "prompt", "kwargs", "text", "reasoning", "content"), SHAPES)
def test_the_parsers_read_vllms_documented_shapes(
    name, prompt, kwargs, text, reasoning, content
) -> None:
    assert _parse(name, prompt, text, kwargs) == (reasoning, content)


@pytest.mark.parametrize(("name", "prompt", "kwargs", "text", "reasoning", "content"), SHAPES)
def test_tags_split_across_pieces_read_as_whole(
    name, prompt, kwargs, text, reasoning, content
) -> None:
    # Every split of the text in three pieces, the tags cut anywhere.
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            parser = reasoning_format(name, prompt, kwargs).parser()
            got = [parser.feed(piece) for piece in (text[:i], text[i:j], text[j:])]
            got.append(parser.finish())
            streamed = ("".join(g.reasoning for g in got), "".join(g.content for g in got))
            assert (streamed[0] or None, streamed[1] or None) == (reasoning, content), (i, j)


def test_a_partial_tag_is_held_back_until_it_is_decided() -> None:
    parser = reasoning_format("deepseek_r1", "assistant\n").parser()
    assert parser.feed("Hm.</thi").reasoning == "Hm."  # "</thi" may still be the end tag
    piece = parser.feed("nk>4")
    assert (piece.reasoning, piece.content) == ("", "4")
    parser = reasoning_format("deepseek_r1", "assistant\n").parser()
    assert parser.feed("a </t").reasoning == "a "
    assert parser.feed("ask> c").reasoning == "</task> c"  # not a tag after all: reasoning


# ---------------------------------------------------------------- the APIs, scripted

INFO = EngineReady("/model", 4096, 256, 16, [EOS], VOCAB_SIZE, "float32", 1)


async def _post(
    tokenizer: Tokenizer,
    path: str,
    body: dict[str, Any],
    text: str,
    *,
    parser: str | None = "qwen3",
) -> tuple[httpx.Response, ScriptedEngine]:
    """POST ``body`` to an app whose engine 'generates' ``text``."""
    async with trio.open_nursery() as nursery:
        engine, stream = engine_client_pair(INFO)
        fake = ScriptedEngine(stream, tokenizer.encode(text, add_special_tokens=False))
        nursery.start_soon(engine.route_outputs)
        nursery.start_soon(fake.run)
        serving = ModelServing(
            engine, tokenizer, ("m",), tool_call_parser="hermes", reasoning_parser=parser
        )
        transport = httpx.ASGITransport(app=build_app(serving, lambda: True))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post(path, json=body)
        nursery.cancel_scope.cancel()
    return response, fake


QUESTION = [{"role": "user", "content": "2+2?"}]
THOUGHT = "<think>\nTwo and two.\n</think>\n\nIt is 4."


async def test_chat_carries_reasoning_and_reasoning_content(qwen3_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION}
    whole, _ = await _post(qwen3_tokenizer, "/v1/chat/completions", body, THOUGHT)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nTwo and two.\n"
    assert message["content"] == "\n\nIt is 4."
    streamed, _ = await _post(
        qwen3_tokenizer, "/v1/chat/completions", {**body, "stream": True}, THOUGHT
    )
    reasoning = content = reasoning_content = ""
    for _, event in named_events(streamed.text)[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            assert "<think>" not in (delta.get("content") or "")
            reasoning += delta.get("reasoning") or ""
            reasoning_content += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert reasoning == reasoning_content == "\nTwo and two.\n"
    assert content == "\n\nIt is 4."


async def test_an_output_cut_off_while_reasoning_has_null_content(qwen3_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION}
    response, _ = await _post(qwen3_tokenizer, "/v1/chat/completions", body, "<think>\nTwo")
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\nTwo", None)


async def test_without_a_reasoning_parser_the_tags_stay_in_the_content(qwen3_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION}
    response, _ = await _post(qwen3_tokenizer, "/v1/chat/completions", body, THOUGHT, parser=None)
    message = response.json()["choices"][0]["message"]
    assert message["content"] == THOUGHT and "reasoning" not in message


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALLING = (
    "<think>\nI need the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


async def test_the_tool_call_parser_reads_what_follows_the_reasoning(qwen3_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "tools": WEATHER_TOOLS}
    whole, _ = await _post(qwen3_tokenizer, "/v1/chat/completions", body, CALLING)
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning"] == "\nI need the weather.\n"
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    streamed, _ = await _post(
        qwen3_tokenizer, "/v1/chat/completions", {**body, "stream": True}, CALLING
    )
    reasoning, arguments, content = "", "", ""
    for _, event in named_events(streamed.text)[:-1]:
        delta = event["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():
            arguments += call["function"]["arguments"]
    assert reasoning == message["reasoning"]
    assert content == ""
    assert json.loads(arguments) == {"city": "Oslo"}


def _prompt_text(fake: ScriptedEngine, tokenizer: Tokenizer) -> str:
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    return tokenizer.decode(added.prompt_token_ids, skip_special_tokens=False)


async def test_chat_template_kwargs_reach_the_template(qwen3_tokenizer) -> None:
    body = {"model": "m", "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}
    response, fake = await _post(
        qwen3_tokenizer, "/v1/chat/completions", body, "<think>x</think>It is 4."
    )
    assert _prompt_text(fake, qwen3_tokenizer).endswith("assistant\n<think>\n\n</think>\n\n")
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "<think>x</think>It is 4.")
    _, fake = await _post(
        qwen3_tokenizer, "/v1/chat/completions", {**body, "chat_template_kwargs": {}}, ""
    )
    assert _prompt_text(fake, qwen3_tokenizer).endswith("assistant\n")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "eos_token"])
async def test_chat_template_kwargs_cannot_replace_the_servers_variables(
    qwen3_tokenizer, key
) -> None:
    body = {"model": "m", "messages": QUESTION, "chat_template_kwargs": {key: 1}}
    response, _ = await _post(qwen3_tokenizer, "/v1/chat/completions", body, "")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


async def test_responses_carry_a_reasoning_item(qwen3_tokenizer) -> None:
    from openai.types.responses import Response, ResponseStreamEvent

    body = {"model": "m", "input": "2+2?"}
    whole, _ = await _post(qwen3_tokenizer, "/v1/responses", body, THOUGHT)
    assert whole.status_code == 200, whole.text
    # (usage is another part's: this openai release wants fields it lacks)
    response = Response.model_validate({**whole.json(), "usage": None})
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nTwo and two.\n")]
    assert reasoning.id.startswith("rs_")
    assert message.type == "message" and message.content[0].text == "\n\nIt is 4."
    assert response.output_text == "\n\nIt is 4."

    streamed, _ = await _post(qwen3_tokenizer, "/v1/responses", {**body, "stream": True}, THOUGHT)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [
        adapter.validate_python(_without_usage(data)) for _, data in named_events(streamed.text)
    ]
    kinds = [e.type for e in events if e.type != "response.reasoning_text.delta"]
    assert kinds[:6] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.done",
        "response.content_part.done",
    ]
    assert kinds[6] == "response.output_item.done"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "\nTwo and two.\n"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.model_dump(exclude_none=True) == reasoning.model_dump(
        exclude_none=True, exclude={"id"}
    ) | {"id": done[0].item.id}
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]


def _without_usage(event: dict[str, Any]) -> dict[str, Any]:
    if "response" in event:
        return {**event, "response": {**event["response"], "usage": None}}
    return event


async def test_messages_carry_a_thinking_block_with_a_signature(qwen3_tokenizer) -> None:
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import Message

    body = {"model": "m", "max_tokens": 100, "messages": QUESTION}
    whole, _ = await _post(qwen3_tokenizer, "/v1/messages", body, THOUGHT)
    assert whole.status_code == 200, whole.text
    message = Message.model_validate(whole.json())
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "\nTwo and two.\n"
    assert thinking.signature  # an opaque, non-empty string
    assert text.type == "text" and text.text == "\n\nIt is 4."

    streamed, _ = await _post(qwen3_tokenizer, "/v1/messages", {**body, "stream": True}, THOUGHT)
    events = named_events(streamed.text)
    deltas = [d["delta"]["type"] for name, d in events if name == "content_block_delta"]
    assert deltas[0] == "thinking_delta"
    # the signature closes the thinking block, then the text block follows
    signature_at = deltas.index("signature_delta")
    assert set(deltas[:signature_at]) == {"thinking_delta"}
    assert set(deltas[signature_at + 1 :]) == {"text_delta"}
    snapshot = None
    for _, data in events:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})
    assert snapshot is not None
    assert [b.model_dump() for b in snapshot.content] == [b.model_dump() for b in message.content]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages",
            {"max_tokens": 50, "messages": QUESTION, "thinking": {"type": "disabled"}},
        ),
        ("/v1/responses", {"input": "2+2?", "reasoning": {"effort": "none"}}),
        ("/v1/messages/count_tokens", {"messages": QUESTION, "thinking": {"type": "disabled"}}),
    ],
)
async def test_anthropic_and_responses_switches_turn_thinking_off(
    qwen3_tokenizer, path, body
) -> None:
    body = {"model": "m", **body}
    response, fake = await _post(qwen3_tokenizer, path, body, "<think>x</think>4")
    assert response.status_code == 200, response.text
    closed = qwen3_tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    if path.endswith("count_tokens"):
        plain, _ = await _post(qwen3_tokenizer, path, {**body, "thinking": None}, "")
        assert response.json()["input_tokens"] == plain.json()["input_tokens"] + len(closed)
        return
    assert _prompt_text(fake, qwen3_tokenizer).endswith("assistant\n<think>\n\n</think>\n\n")
    answer = response.json()
    if path == "/v1/messages":
        assert [block["type"] for block in answer["content"]] == ["text"]
        assert answer["content"][0]["text"] == "<think>x</think>4"
    else:
        assert [item["type"] for item in answer["output"]] == ["message"]


# ---------------------------------------------------------------- constraints


@pytest.fixture(scope="module")
def grammars(qwen3_dir: Path):
    compiler = GrammarCompiler(qwen3_dir, VOCAB_SIZE, frozenset({EOS}))
    yield compiler
    compiler.close()


def _accepts(grammars: GrammarCompiler, spec, tokenizer: Tokenizer, text: str) -> bool:
    matcher = grammars.matcher(spec)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"regex": r"\{\"answer\":[0-9]\}"}},
        {"structured_outputs": {"choice": ['{"answer":4}', '{"answer":5}']}},
    ],
)
async def test_a_constraint_holds_only_after_the_reasoning(
    qwen3_tokenizer, grammars, constraint
) -> None:
    body = {"model": "m", "messages": QUESTION, **constraint}
    response, fake = await _post(
        qwen3_tokenizer, "/v1/chat/completions", body, '<think>\nHm.</think>{"answer":4}'
    )
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\nHm.", '{"answer":4}')
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    spec = added.params.structured_output
    assert spec is not None and spec.prefix
    accepts = lambda text: _accepts(grammars, spec, qwen3_tokenizer, text)  # noqa: E731
    assert accepts('<think>\nHm, "answer": six? {no</think>{"answer":4}')  # reasoning is free
    assert accepts('{"answer":4}')  # qwen3: the reasoning may be left out
    assert not accepts("<think>\nHm.</think>The answer is 4.")  # the answer is held
    assert not accepts('<think>\nHm.</think>\n\n{"answer":4}')  # from the first token
    assert not accepts('<think>\nHm.{"answer":4}')  # no answer before </think>

    # Without reasoning (switched off), the constraint holds from the first token.
    body["chat_template_kwargs"] = {"enable_thinking": False}
    _, fake = await _post(qwen3_tokenizer, "/v1/chat/completions", body, '{"answer":4}')
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    assert added.params.structured_output is not None
    assert added.params.structured_output.prefix == ""


async def test_a_forced_tool_call_follows_the_reasoning(qwen3_tokenizer, grammars) -> None:
    body = {
        "model": "m",
        "messages": QUESTION,
        "tools": WEATHER_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    output = '<think>\nOslo.</think>{"city":"Oslo"}'
    response, fake = await _post(qwen3_tokenizer, "/v1/chat/completions", body, output)
    message = response.json()["choices"][0]["message"]
    assert message["reasoning"] == "\nOslo."
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'
    (added,) = [m for m in fake.received if isinstance(m, AddRequest)]
    spec = added.params.structured_output
    assert _accepts(grammars, spec, qwen3_tokenizer, output)
    assert not _accepts(grammars, spec, qwen3_tokenizer, '<think>\nOslo.</think>{"city":4}')


def test_deepseek_r1_reasons_first_and_a_spelled_out_end_tag_cannot_end_it(
    qwen3_tokenizer, grammars
) -> None:
    from trio_llm.messages import StructuredOutput

    prefix = reasoning_format("deepseek_r1", "assistant\n").grammar(qwen3_tokenizer.added_token_id)
    assert prefix is not None
    spec = StructuredOutput("choice", '["yes", "no"]', prefix)
    assert _accepts(grammars, spec, qwen3_tokenizer, "Hm.</think>yes")
    assert _accepts(grammars, spec, qwen3_tokenizer, "<think>Hm.</think>no")
    assert not _accepts(grammars, spec, qwen3_tokenizer, "yes")  # reasoning comes first
    matcher = grammars.matcher(spec)
    spelled = qwen3_tokenizer.encode("Hm.</", add_special_tokens=False)
    spelled += qwen3_tokenizer.encode("think>", add_special_tokens=False)
    assert END_THINK not in spelled
    # The end tag's text, spelled out of other tokens, is refused: only its token ends
    # the reasoning (the parser reads the text, so the two would disagree).
    assert not matcher.consume_tokens(spelled)


# ---------------------------------------------------------------- a tiny Qwen3, in the engine


@pytest.mark.slow
def test_the_engine_holds_a_tiny_qwen3_to_the_answer_only_after_the_reasoning(
    tmp_path: Path, qwen3_dir: Path, qwen3_tokenizer
) -> None:
    """A random-weight Qwen3 made from a config, pushed to end its reasoning at once
    (``logit_bias`` on ``</think>``): its answer is then one of the choices."""
    from tests.support.architectures import save_for_serving
    from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from trio_llm.engine.core import EngineCore
    from trio_llm.messages import SamplingParams, StructuredOutput
    from trio_llm.model_files.loader import load_model

    model_dir = save_for_serving("qwen3", tmp_path / "qwen3", qwen3_dir, VOCAB_SIZE)
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=128),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
    )
    core = EngineCore(load_model(model_dir, "float32", "sdpa"), config, str(model_dir))
    prompt = qwen3_tokenizer.encode("<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n")
    reasoning = reasoning_format("deepseek_r1", "assistant\n")
    choices = '["yes", "no"]'
    specs = {
        "after": StructuredOutput(
            "choice", choices, reasoning.grammar(qwen3_tokenizer.added_token_id)
        ),
        "plain": StructuredOutput("choice", choices),
    }
    for name, spec in specs.items():
        params = SamplingParams(
            max_tokens=12, seed=0, logit_bias=((END_THINK, 100.0),), structured_output=spec
        )
        assert core.add_request(AddRequest(name, prompt, params)) is None
    tokens: dict[str, list[int]] = {name: [] for name in specs}
    finish: dict[str, str] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                finish[output.request_id] = output.finish_reason
    assert finish == {"after": "stop", "plain": "stop"}
    after = qwen3_tokenizer.decode(tokens["after"])
    assert tokens["after"][0] == END_THINK  # the bias ended the reasoning at once
    split = reasoning.parser().parse(after)
    assert (split.reasoning, split.content) in [("", "yes"), ("", "no")]
    # Without the reasoning part the grammar refuses </think>: the answer comes first.
    assert END_THINK not in tokens["plain"]
    assert qwen3_tokenizer.decode(tokens["plain"]) in ("yes", "no")
