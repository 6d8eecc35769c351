"""/tokenize, /detokenize and /version on the shared real server (vLLM's shapes)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import httpx
import pytest

import trio_llm
from tests.e2e.conftest import MODEL

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        yield http


def _max_model_len(client: httpx.Client) -> int:
    return client.get("/v1/models").json()["data"][0]["max_model_len"]


def test_tokenize_a_prompt(client: httpx.Client, smol_tokenizer) -> None:
    response = client.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == smol_tokenizer.encode(TEXT)
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == _max_model_len(client)
    assert body["token_strs"] is None


def test_token_strs_are_the_vocabulary_strings(client: httpx.Client, smol_tokenizer) -> None:
    body = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"]
    vocab = smol_tokenizer.backend.get_vocab(with_added_tokens=True)
    assert [vocab[s] for s in body["token_strs"]] == body["tokens"]
    assert "Ġquick" in body["token_strs"]  # byte-level BPE spells the space as Ġ


def test_tokenize_chat_messages(client: httpx.Client, smol_tokenizer) -> None:
    body = client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert body["tokens"] == smol_tokenizer.encode(
        smol_tokenizer.render_chat(CHAT), add_special_tokens=False
    )
    assert body["count"] == len(body["tokens"])
    assert len(body["token_strs"]) == body["count"]
    assert body["token_strs"].count("<|im_start|>") == 3  # system, user, assistant
    prompt = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    without = client.post(
        "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
    ).json()
    assert without["count"] < body["count"]
    assert body["tokens"][: without["count"]] == without["tokens"]
    text = client.post("/detokenize", json={"tokens": without["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert text.endswith("What is the capital of France?<|im_end|>\n")


def test_a_final_assistant_message_can_be_left_open(client: httpx.Client) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    closed = client.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    open_ = client.post(
        "/tokenize", json={"messages": messages, "continue_final_message": True}
    ).json()
    text = client.post("/detokenize", json={"tokens": open_["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital is")
    # The same conversation, without the end of the assistant's turn.
    assert closed["tokens"][: open_["count"]] == open_["tokens"]
    ending = client.post("/detokenize", json={"tokens": closed["tokens"][open_["count"] :]})
    assert ending.json()["prompt"] == "<|im_end|>\n"


def test_detokenize_round_trips(client: httpx.Client) -> None:
    for text in [TEXT, " leading space", "trailing newline\n", ""]:
        tokens = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        response = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        assert response.status_code == 200, response.text
        assert response.json() == {"prompt": text}


def test_counts_agree_with_the_completion_routes(client: httpx.Client) -> None:
    count = client.post("/tokenize", json={"prompt": TEXT}).json()["count"]
    completion = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1}
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == count

    chat_count = client.post("/tokenize", json={"messages": CHAT}).json()["count"]
    chat = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == chat_count


def test_a_text_longer_than_the_context_is_counted(client: httpx.Client) -> None:
    body = client.post("/tokenize", json={"prompt": "word " * 9000}).json()
    assert body["count"] > body["max_model_len"]


def _assert_400(response: httpx.Response, param: str | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize(
    "tokens",
    [[1, 10**6], [-1], [2**40], ["a"], [1.5], None, "1 2"],
    ids=["past-vocab", "negative", "huge", "string", "float", "null", "not-a-list"],
)
def test_detokenize_refuses_bad_ids(client: httpx.Client, tokens: object) -> None:
    _assert_400(client.post("/detokenize", json={"tokens": tokens}), "tokens")
    # Nothing else is disturbed.
    assert client.post("/detokenize", json={"tokens": [19556]}).json() == {"prompt": "Hello"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": CHAT}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        # CHAT ends with a user message: there is nothing to continue.
        ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ({"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ],
)
def test_tokenize_refuses_bad_input(client: httpx.Client, body: dict, param: str) -> None:
    _assert_400(client.post("/tokenize", json=body), param)


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b'"text"'])
def test_non_object_bodies_get_400(client: httpx.Client, payload: bytes) -> None:
    for path in ("/tokenize", "/detokenize"):
        response = client.post(path, content=payload, headers={"content-type": "application/json"})
        _assert_400(response, None)


def test_an_unknown_model_gets_404(client: httpx.Client) -> None:
    for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
        response = client.post(path, json={"model": "no-such-model", **body})
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["param"] == "model"


def test_version(client: httpx.Client) -> None:
    response = client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": trio_llm.__version__}
    assert trio_llm.__version__ == importlib.metadata.version("trio_llm")
