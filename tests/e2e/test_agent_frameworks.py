"""Agent frameworks nobody here wrote, each running one agent with a tool and a typed
output against the shared server (SmolLM2, hermes tool parser): the request carries
``tools`` and a response format together, the most common agent pattern (issue 31).

- the OpenAI Agents SDK: ``Agent(tools=[...], output_type=Model)`` through its Chat
  Completions model and its Responses model;
- pydantic-ai: ``Agent(OpenAIChatModel(...), output_type=NativeOutput(Model), tools=[...])``;
- LangChain 1.x: ``create_agent(ChatOpenAI(...), tools=[...],
  response_format=ProviderStrategy(Model))``;
- LiteLLM: a prompt over the 8,192-token context raises its ``ContextWindowExceededError``
  (what aider and the LiteLLM proxy act on), through the ``openai/``, ``hosted_vllm/`` and
  ``anthropic/`` providers.

A 135M model does not reason well, so an agent's run is held to what a server owes it:
every request answered without an error, and a final output that the framework itself
validates into ``Weather`` (a tool call or two on the way is the model's choice).
Greedy sampling and small ``max_tokens`` keep each run to seconds. Each framework is
skipped where it is not installed (they are in the dev extras).
"""

from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import MODEL

QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Use the get_weather tool, then answer with the city and a short summary."
MAX_TOKENS = 100
#: Model turns an agent may take (a tool call, its result, the answer; one spare).
MAX_TURNS = 4


class Weather(BaseModel):
    """The typed answer. Closed (``additionalProperties: false``) and short, so the
    answer held to it ends well inside ``MAX_TOKENS``."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=20)
    summary: str = Field(max_length=40)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 C and light rain in {city}"


@pytest.fixture
def no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No LangSmith / OpenAI tracing export: the tests reach nothing but the server."""
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_tool_and_output_type(base_url: str, no_tracing: None, api: str) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    async def run() -> object:
        async with AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0
        ) as client:
            if api == "chat_completions":
                model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            else:
                model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
            agent = agents.Agent(
                name="weather",
                instructions=INSTRUCTIONS,
                model=model,
                tools=[agents.function_tool(get_weather)],
                output_type=Weather,
                model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
            )
            config = agents.RunConfig(tracing_disabled=True)
            result = await agents.Runner.run(
                agent, QUESTION, max_turns=MAX_TURNS, run_config=config
            )
            return result.final_output

    assert isinstance(asyncio.run(run()), Weather)


def test_pydantic_ai_native_output_with_a_tool(base_url: str) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{base_url}/v1", api_key="unused")
    agent = Agent(
        OpenAIChatModel(MODEL, provider=provider),
        instructions=INSTRUCTIONS,
        output_type=NativeOutput(Weather),
        tools=[get_weather],
        model_settings={"temperature": 0, "max_tokens": MAX_TOKENS},
    )
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, Weather)


def test_langchain_create_agent_with_a_provider_strategy(base_url: str, no_tracing: None) -> None:
    pytest.importorskip("langchain.agents")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ProviderStrategy

    chat = langchain_openai.ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    agent = create_agent(
        model=chat,
        tools=[get_weather],
        system_prompt=INSTRUCTIONS,
        response_format=ProviderStrategy(Weather),
    )
    state = agent.invoke(
        {"messages": [{"role": "user", "content": QUESTION}]},
        {"recursion_limit": 2 * MAX_TURNS + 1},
    )
    assert isinstance(state["structured_response"], Weather)


#: (LiteLLM provider prefix, the route it calls): chat completions twice, Messages once.
LITELLM_PROVIDERS = [("openai", "/v1"), ("hosted_vllm", "/v1"), ("anthropic", "")]


@pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")
@pytest.mark.parametrize(("provider", "path"), LITELLM_PROVIDERS)
def test_litellm_maps_a_context_overflow_to_context_window_exceeded(
    base_url: str, provider: str, path: str
) -> None:
    """About 9,000 prompt tokens against the 8,192-token context."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"{provider}/{MODEL}",
            api_base=f"{base_url}{path}",
            api_key="unused",
            messages=[{"role": "user", "content": "hello " * 9000}],
            max_tokens=10,
            temperature=0,
            num_retries=0,
        )
