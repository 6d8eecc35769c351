"""Models the engine would serve wrongly are refused at start-up, naming why (issue 16's
first slice): checked on transformers' own configurations, no weights needed."""

import pytest
from transformers import AutoConfig

from trio_llm.engine.support import check_supported
from trio_llm.errors import EngineConfigError


def _config(model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


@pytest.mark.parametrize(
    ("model_type", "fields", "max_model_len"),
    [
        ("llama", {}, 8192),
        ("qwen2", {}, 8192),  # its sliding_window is off (use_sliding_window=False)
        ("qwen3_moe", {}, 8192),
        ("mistral", {"sliding_window": None}, 8192),
        ("mistral", {"sliding_window": 4096}, 4096),  # the window never binds
        ("gemma3_text", {"sliding_window": 512}, 512),
        ("granite", {"logits_scaling": 1.0}, 4096),
    ],
)
def test_served_exactly(model_type: str, fields: dict, max_model_len: int) -> None:
    check_supported(_config(model_type, **fields), max_model_len)


@pytest.mark.parametrize(
    ("model_type", "fields", "max_model_len", "message"),
    [
        ("mistral", {"sliding_window": 16}, 64, r"sliding-window .* --max-model-len 16 or less"),
        ("gemma3_text", {"sliding_window": 512}, 1200, r"Gemma3Text.* \(512 tokens\)"),
        ("starcoder2", {"sliding_window": 32}, 4096, "sliding-window"),
        ("gemma2", {"sliding_window": 4096}, 4096, "not been verified"),
        ("gemma", {"attn_logit_softcapping": 50.0}, 4096, "attention logit softcapping"),
        ("gemma", {"final_logit_softcapping": 30.0}, 4096, "final logit softcapping"),
        ("granite", {"logits_scaling": 8.0}, 4096, r"logits are scaled \(logits_scaling=8.0\)"),
        ("cohere", {}, 4096, r"logit_scale=0.0625"),
        ("gpt_neox", {}, 2048, r"GPTNeoX.* \(gpt_neox\) is not supported: .* not been verified"),
        ("phi", {}, 2048, "not been verified"),
        ("stablelm", {}, 2048, "not been verified"),
    ],
)
def test_refused_with_the_reason(
    model_type: str, fields: dict, max_model_len: int, message: str
) -> None:
    with pytest.raises(EngineConfigError, match=message):
        check_supported(_config(model_type, **fields), max_model_len)
