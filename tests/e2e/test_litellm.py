"""LiteLLM, a client nobody here wrote, through each API the server speaks: OpenAI chat and
Responses (``openai/`` provider) and Anthropic Messages (``anthropic/`` provider)."""

from __future__ import annotations

import os

import pytest

from tests.e2e.conftest import MODEL, openai_client

# LiteLLM fetches a price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

# LiteLLM's own typing (a TypedDict with ReadOnly items) warns inside pydantic on first use.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture
def reference(base_url: str) -> str:
    """The greedy chat answer, from the openai SDK."""
    with openai_client(base_url) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=20
        )
    return reply.choices[0].message.content


def test_every_api_gives_the_chat_answer(base_url: str, reference: str) -> None:
    common = {"api_key": "unused", "temperature": 0}
    chat = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{base_url}/v1",
        messages=QUESTION,
        max_tokens=20,
        **common,
    )
    assert chat.choices[0].message.content == reference
    responses = litellm.responses(
        model=f"openai/{MODEL}",
        api_base=f"{base_url}/v1",
        input=QUESTION[0]["content"],
        max_output_tokens=20,
        **common,
    )
    assert responses.output[0].content[0].text == reference
    messages = litellm.completion(
        model=f"anthropic/{MODEL}", api_base=base_url, messages=QUESTION, max_tokens=20, **common
    )
    assert messages.choices[0].message.content == reference
    streamed = litellm.completion(
        model=f"anthropic/{MODEL}",
        api_base=base_url,
        messages=QUESTION,
        max_tokens=20,
        stream=True,
        **common,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == reference


def test_anthropic_tool_calls_come_back_as_openai_tool_calls(base_url: str) -> None:
    reply = litellm.completion(
        model=f"anthropic/{MODEL}",
        api_base=base_url,
        api_key="unused",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        # One call (disable_parallel_tool_use): held to its schema, SmolLM2 repeats the
        # same call until max_tokens when it may make several.
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    assert all(call.function.name == "get_weather" for call in choice.message.tool_calls)
    assert all(call.id for call in choice.message.tool_calls)


def test_an_error_reaches_the_caller_as_a_bad_request(base_url: str) -> None:
    with pytest.raises(litellm.BadRequestError, match="embedding model"):
        litellm.embedding(
            model=f"openai/{MODEL}", api_base=f"{base_url}/v1", api_key="unused", input=["hi"]
        )
