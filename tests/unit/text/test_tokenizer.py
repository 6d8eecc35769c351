"""The API process's tokenizer matches transformers' tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_llm.errors import ChatTemplateError
from trio_llm.text.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Count to three. 🎉"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def reference(real_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    smol_tokenizer: Tokenizer,
    reference,
    messages: list[dict],
) -> None:
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smol_tokenizer.encode(
        smol_tokenizer.render_chat(messages), add_special_tokens=False
    ) == reference.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("text", ["Hello world", " leading space", "naïve 東京 🎉", "<|im_end|> x"])
def test_encode_and_decode_match_transformers(
    smol_tokenizer: Tokenizer,
    reference,
    text: str,
) -> None:
    ids = smol_tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert smol_tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_templates_can_reject_conversations(smol_tokenizer: Tokenizer) -> None:
    strict = Tokenizer(
        smol_tokenizer.backend,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x",
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.render_chat([{"role": "assistant", "content": "hi"}])
    assert strict.encode(
        strict.render_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False
    ) == strict.encode("x", add_special_tokens=False)


def test_a_model_without_template_is_refused(smol_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(smol_tokenizer.backend).render_chat([{"role": "user", "content": "x"}])


def test_a_lone_surrogate_is_named_in_the_error(smol_tokenizer) -> None:
    from trio_llm.errors import InvalidTextError

    with pytest.raises(InvalidTextError, match=r"surrogate .* at character 2"):
        smol_tokenizer.encode("hi\ud800 there")
