"""The official openai client against the real server and model."""

from __future__ import annotations

import httpx
from openai import OpenAI

from tests.e2e.conftest import MODEL, parallel

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_greedy_chat_answers_paris(base_url: str) -> None:
    reply = _client(base_url).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_the_non_streamed_text(base_url: str) -> None:
    client = _client(base_url)
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=40
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.created == chunks[0].created for c in chunks)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == whole.choices[0].finish_reason
    assert all(reason is None for reason in finishing[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_completion_equals_the_non_streamed_text(base_url: str) -> None:
    client = _client(base_url)
    prompt = "Shall I compare thee to a summer's day? 🌞 Thou art"
    # Both at once: the engine batches them, which costs about what one alone does.
    whole, streamed = parallel(
        lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0),
        lambda: list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True
            )
        ),
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].finish_reason in {"stop", "length"}
    assert whole.usage.prompt_tokens > 10


def test_token_id_prompts_and_max_tokens_give_length(base_url: str) -> None:
    reply = _client(base_url).completions.create(
        model=MODEL,
        prompt=[504, 3458, 282],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens == 3


def test_models_and_health(base_url: str) -> None:
    models = _client(base_url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_models_are_listed_and_retrieved(base_url: str) -> None:
    client = _client(base_url)
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    # vLLM's card fields: clients that pick a context length or check permissions read them.
    extra = card.model_extra or {}
    assert extra["max_model_len"] > 0 and extra["root"]
    assert extra["permission"][0]["object"] == "model_permission"
    assert extra["permission"][0]["allow_sampling"] is True


def test_completions_default_to_16_tokens(base_url: str) -> None:
    reply = _client(base_url).completions.create(
        model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"
