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

A 135M model does not reason well (left to itself it calls the tool again after every
result), so an agent's run is held to what a server owes it: every request answered
without an error, and a final output that the framework itself validates into
``Weather``. The first request offers the tool and the answer format together
(``tool_choice`` auto: a call or the answer); once called, the tool is withdrawn through
each framework's own hook (the Agents SDK: ``tool_choice`` none), so the next request asks
for the answer alone and the run ends in one or two model turns. Greedy sampling, one
call per turn and small ``max_tokens`` keep each run to seconds. Each framework is
skipped where it is not installed (they are in the dev extras).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
from collections.abc import Callable, Iterator

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import MODEL


@pytest.fixture(autouse=True, scope="module")
def no_event_loop_left_behind() -> Iterator[None]:
    """After the module: drop the thread's asyncio loop and collect, so that a loop or a
    connection a framework left open is reported here, not in some later module's test."""
    yield
    asyncio.set_event_loop(None)
    gc.collect()


QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "Use the get_weather tool, then answer with the city and a short summary."
MAX_TOKENS = 100
#: Model turns an agent may take (a tool call, then the answer; one spare).
MAX_TURNS = 3


# Closed (additionalProperties false) and short, so that an answer held to it ends well
# inside MAX_TOKENS.
class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=20)
    summary: str = Field(max_length=40)


def weather_tool() -> tuple[Callable[[str], str], list[str]]:
    """``get_weather`` and the list of the cities it was called with."""
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"18 C and light rain in {city}"

    return get_weather, calls


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

    get_weather, _ = weather_tool()

    class AnswerAfterTheCall(agents.AgentHooks):
        """``tool_choice: "none"`` from the call's result on (the tool stays listed:
        the Responses input's function_call items need it)."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

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
                hooks=AnswerAfterTheCall(),
                reset_tool_choice=False,
                model_settings=agents.ModelSettings(
                    temperature=0, max_tokens=MAX_TOKENS, parallel_tool_calls=False
                ),
            )
            config = agents.RunConfig(tracing_disabled=True)
            result = await agents.Runner.run(
                agent, QUESTION, max_turns=MAX_TURNS, run_config=config
            )
            return result.final_output

    assert isinstance(asyncio.run(run()), Weather)


def test_pydantic_ai_native_output_with_a_tool(base_url: str) -> None:
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, NativeOutput, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    get_weather, calls = weather_tool()

    async def until_called(context, definition):
        return None if calls else definition

    async def run() -> object:
        # Not `run_sync`: it leaves an open event loop (and its connections) behind, which
        # the garbage collector then reports in whichever later test it runs.
        async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused") as client:
            provider = OpenAIProvider(openai_client=client)
            agent = Agent(
                OpenAIChatModel(MODEL, provider=provider),
                instructions=INSTRUCTIONS,
                output_type=NativeOutput(Weather),
                tools=[Tool(get_weather, prepare=until_called)],
                model_settings={
                    "temperature": 0,
                    "max_tokens": MAX_TOKENS,
                    "parallel_tool_calls": False,
                },
            )
            return (await agent.run(QUESTION)).output

    assert isinstance(asyncio.run(run()), Weather)


def test_langchain_create_agent_with_a_provider_strategy(base_url: str, no_tracing: None) -> None:
    pytest.importorskip("langchain.agents")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain.agents.structured_output import ProviderStrategy

    get_weather, calls = weather_tool()

    @wrap_model_call
    def until_called(request, handler):
        return handler(request.override(tools=[]) if calls else request)

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
        middleware=[until_called],
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
