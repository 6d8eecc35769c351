"""The request models of the OpenAI-compatible routes, sans I/O: raw JSON bodies parsed as
the routes parse them (`trio_llm.api.http.parsing.validate`), the 400s naming the field at fault,
and the `SamplingParams` / `StructuredOutput` a valid body asks of the engine.

The expectations are written from the OpenAI API reference (defaults, ranges, the meaning
of each field) and vLLM's documentation of its extensions, not from the code's output.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_llm.api.chat.completion_request import CompletionRequest
from trio_llm.api.chat.generation_request import GenerationRequest
from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.http.errors import APIError
from trio_llm.api.http.parsing import validate
from trio_llm.messages import SamplingParams, StructuredOutput
from trio_llm.server_config import RequestLimits

VOCAB = 1000
USER = {"role": "user", "content": "Say hi."}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def _parse(model: type[GenerationRequest], body: dict[str, Any]) -> Any:
    return validate(model, body, RequestLimits(), max_model_len=4096, vocab_size=VOCAB)


def _refusal(model: type[GenerationRequest], body: dict[str, Any]) -> APIError:
    """The 400 for ``body``: from validation, the unsupported-field check, the sampling
    parameters or the output constraint, whichever refuses it first."""
    with pytest.raises(APIError) as refused:
        request = _parse(model, body)
        request.check_supported()
        request.sampling_params(16, VOCAB)
    assert refused.value.status == 400
    assert refused.value.type == "invalid_request_error"
    return refused.value


# ------------------------------------------------------------------ sampling parameters


def test_an_empty_chat_body_samples_with_openais_defaults() -> None:
    # OpenAI: temperature 1, top_p 1, no penalties, no stop, no logit_bias, one choice.
    request = _parse(ChatCompletionRequest, _chat())
    assert request.n == 1 and not request.stream
    expected: dict[str, Any] = {
        "max_tokens": 16,
        "min_tokens": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": (),
        "seed": None,
        "stop_token_ids": (),
        "ignore_eos": False,
        "stop": (),
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "structured_output": None,
    }
    assert request.sampling_params(16, VOCAB) == SamplingParams(**expected)


def test_every_sampling_field_reaches_the_engine() -> None:
    body = _chat(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"7": -100, "12": 150, "3": -250},  # clamped to [-100, 100]
        seed=1234,
        stop=["END", ""],  # an empty stop string stops nothing
        stop_token_ids=[2],
        min_tokens=3,
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    params = _parse(ChatCompletionRequest, body).sampling_params(64, VOCAB, logprobs=2)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.2, 0.9, 40, 0.05)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.1
    assert params.logit_bias == ((7, -100.0), (12, 100.0), (3, -100.0))
    assert (params.seed, params.stop, params.stop_token_ids) == (1234, ("END",), (2,))
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (64, 3, 2)
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens


def test_a_single_stop_string_is_one_stop() -> None:
    params = _parse(ChatCompletionRequest, _chat(stop="\n\n")).sampling_params(16, VOCAB)
    assert params.stop == ("\n\n",)


def test_server_defaults_fill_only_the_fields_left_unset() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    request = _parse(ChatCompletionRequest, _chat(temperature=0.0, top_k=None))
    params = request.sampling_params(16, VOCAB, defaults=defaults)
    # temperature 0 is the client's (greedy); an explicit null means "the default".
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 20)


def test_a_completion_defaults_to_16_tokens_and_takes_every_prompt_shape() -> None:
    # OpenAI: max_tokens defaults to 16; prompt is a string, strings, token ids or lists.
    for prompt in ("Once", ["Once", "Twice"], [1, 2, 3], [[1, 2], [3]]):
        request = _parse(CompletionRequest, {"prompt": prompt})
        assert request.prompt == prompt
        assert request.max_tokens == 16
        assert not request.echo and request.logprobs is None


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),  # (0, 1]
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),  # vLLM: -1 (or 0) disables it
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),  # [-2, 2]
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),  # vLLM caps it at 2
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": 2**63}, "seed"),  # a 64-bit integer
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": 0}, "max_tokens"),  # chat: at least 1
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),  # lone surrogate
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"logit_bias": {"word": 1}}, "logit_bias"),  # keys are token ids
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),  # ... of this vocabulary
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream
        ({"best_of": 2}, "best_of"),  # accepted only at its neutral value
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template_kwargs": {"messages": []}}, None),  # checked by the template step
    ],
)
def test_a_bad_chat_field_is_a_400_naming_it(fields: dict[str, Any], param: str | None) -> None:
    body = _chat(**fields)
    if param is None:
        request = _parse(ChatCompletionRequest, body)
        with pytest.raises(APIError) as refused:
            request.template_kwargs()
        assert refused.value.param == "chat_template_kwargs"
        return
    assert _refusal(ChatCompletionRequest, body).param == param


def test_a_missing_body_field_is_named() -> None:
    assert _refusal(ChatCompletionRequest, {"model": "m"}).param == "messages"
    assert _refusal(CompletionRequest, {"model": "m"}).param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"suffix": "tail", "echo": False}, None),  # accepted: suffix "" is neutral only
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(
    fields: dict[str, Any], param: str | None
) -> None:
    body = {"prompt": "Once", **fields}
    if param is None:
        request = _parse(CompletionRequest, body)
        assert request.suffix == "tail"
        return
    assert _refusal(CompletionRequest, body).param == param


def test_unknown_fields_are_ignored_and_null_means_the_default() -> None:
    request = _parse(ChatCompletionRequest, _chat(n=None, temperature=None, service_tier="auto"))
    request.check_supported()
    assert request.n == 1 and request.temperature is None
    assert request.sampling_params(16, VOCAB).temperature == 1.0


# ------------------------------------------------------------------ output constraints

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: SCHEMA as the server enforces it: its object schemas list every property allowed.
CLOSED = {**SCHEMA, "additionalProperties": False}


def _constraint(**fields: Any) -> tuple[StructuredOutput | None, str | None]:
    request = _parse(ChatCompletionRequest, _chat(**fields))
    spec = request.structured_output()
    assert request.sampling_params(16, VOCAB).structured_output == spec
    return spec, request.structured_param


def _decoded(spec: StructuredOutput | None) -> tuple[str, Any]:
    assert spec is not None
    return spec.kind, json.loads(spec.spec)


def test_response_format_text_is_no_constraint() -> None:
    assert _constraint(response_format={"type": "text"}) == (None, None)
    assert _constraint() == (None, None)


def test_response_format_json_object_is_any_json_object() -> None:
    spec, param = _constraint(response_format={"type": "json_object"})
    assert (spec, param) == (StructuredOutput("json_object"), "response_format")


def test_response_format_json_schema_holds_the_output_to_the_schema() -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
    }
    spec, param = _constraint(response_format=response_format)
    assert _decoded(spec) == ("json", CLOSED)
    assert param == "response_format"


@pytest.mark.parametrize(
    ("fields", "kind", "spec", "param"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}", "structured_outputs"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", None, "structured_outputs"),
        ({"structured_outputs": {"json": SCHEMA}}, "json", None, "structured_outputs"),
        ({"guided_json": json.dumps(SCHEMA)}, "json", None, "guided_json"),
        ({"guided_regex": "a+b"}, "regex", "a+b", "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, "choice", None, "guided_choice"),
        ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"', "guided_grammar"),
    ],
)
def test_vllms_constraint_fields(
    fields: dict[str, Any], kind: str, spec: str | None, param: str
) -> None:
    constraint, named = _constraint(**fields)
    assert constraint is not None and (constraint.kind, named) == (kind, param)
    if kind == "choice":
        assert json.loads(constraint.spec) == ["yes", "no"]
    elif kind == "json":
        assert json.loads(constraint.spec) == CLOSED
    else:
        assert constraint.spec == spec


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(fields: dict[str, Any], param: str) -> None:
    assert _refusal(ChatCompletionRequest, _chat(**fields)).param == param


# ------------------------------------------------------------------ chat: tools, messages

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": SCHEMA},
}


def test_tool_choice_defaults_as_openai_documents() -> None:
    # "none is the default when no tools are present. auto is the default if tools are."
    assert _parse(ChatCompletionRequest, _chat()).effective_tool_choice == "none"
    with_tools = _parse(ChatCompletionRequest, _chat(tools=[WEATHER]))
    assert with_tools.effective_tool_choice == "auto"
    assert not with_tools.forces_tool_call


def test_a_named_tool_choice_forces_that_function() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = _parse(ChatCompletionRequest, _chat(tools=[WEATHER], tool_choice=choice))
    assert (request.effective_tool_choice, request.forced_function) == ("function", "get_weather")
    assert request.forces_tool_call
    assert request.structured_output() is not None
    assert request.structured_param == "tools"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param"),
    [
        ([{**WEATHER, "function": {"name": "get weather"}}], None, "tools"),  # a space
        ([WEATHER, WEATHER], None, "tools"),  # a repeated name
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools",
        ),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ],
)
def test_a_bad_tool_is_a_400_naming_its_field(
    tools: list[Any], tool_choice: Any, param: str
) -> None:
    body = _chat(tools=tools, tool_choice=tool_choice)
    assert _refusal(ChatCompletionRequest, body).param == param


def test_the_template_sees_text_content_and_decoded_tool_call_arguments() -> None:
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = _parse(ChatCompletionRequest, {"messages": messages})
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
