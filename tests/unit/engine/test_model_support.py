"""Configurations the engine would serve wrongly are refused before any weight is used,
naming the architecture and why; checked on transformers' own configurations. (What a
probe of the layers refuses, and the proof that accepted families are served exactly,
is in test_conformance.py.)"""

import pytest
from transformers import AutoConfig

from trio_llm.engine.support import VERIFIED_MODEL_TYPES, check_supported
from trio_llm.errors import EngineConfigError


def _config(model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


@pytest.mark.parametrize(
    ("model_type", "fields"),
    [
        ("llama", {}),
        ("mistral", {}),
        ("gemma2", {}),
        ("gemma3_text", {}),
        ("granite", {}),
        ("gpt_neox", {}),
    ],
)
def test_accepted_configurations(model_type: str, fields: dict) -> None:
    check_supported(_config(model_type, **fields))


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("t5", {}, r"T5ForCausalLM \(t5\) is not supported: encoder-decoder"),
        ("mamba", {}, r"Mamba.* \(mamba\) is not supported: .* not been verified"),
        ("bloom", {}, r"\(bloom\) is not supported: .* not been verified"),
        (
            "gemma3_text",
            {"layer_types": ["sliding_attention", "chunked_attention"], "num_hidden_layers": 2},
            r"layer types \['chunked_attention'\] are not implemented",
        ),
    ],
)
def test_refused_with_the_reason(model_type: str, fields: dict, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        check_supported(_config(model_type, **fields))


def test_the_message_lists_what_is_supported() -> None:
    with pytest.raises(EngineConfigError) as info:
        check_supported(_config("mamba"))
    for model_type in VERIFIED_MODEL_TYPES:
        assert model_type in str(info.value)
