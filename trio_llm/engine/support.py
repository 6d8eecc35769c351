"""Which models the engine serves correctly, checked before it reports ready.

The engine runs transformers' own model code with its paged attention plugged in
(`trio_llm.engine.attention`) and computes logits from the output projection's weight
(`trio_llm.engine.model_runner`). That is exact for the architectures below, as their
configurations are checked here; anything else would be served with wrong tokens or wrong
logprobs, so it is refused at start-up with a message naming the architecture and why:

- model families not verified against transformers' ``generate()`` (GPT-NeoX, Phi-1/2 and
  StableLM, for example, need the key/value head counts of the layers themselves);
- sliding-window attention narrower than the context (Mistral, Starcoder2, Gemma 2/3):
  the paged attention attends to the whole context. With ``--max-model-len`` at most the
  window, the window never binds and the model is served exactly;
- attention or final logit softcapping (Gemma 2), logit scaling (Granite's
  ``logits_scaling``, Cohere's ``logit_scale``), and an output projection with a bias:
  the runner's logits skip the model's own final processing.
"""

from __future__ import annotations

from typing import Any

from trio_llm.errors import EngineConfigError

#: ``model_type`` of the families whose outputs matched transformers' ``generate()`` token
#: for token (tiny random-weight models, fp32, greedy), once their configuration passes
#: the checks of `check_supported`.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma3_text",
        "phi3",
        "olmo2",
        "granite",
        "cohere",
        "starcoder2",
    }
)


def describe(config: Any) -> str:
    """The architecture's name for messages, e.g. ``"MistralForCausalLM (mistral)"``."""
    model_type = getattr(config, "model_type", None) or "unknown"
    architectures = getattr(config, "architectures", None) or []
    return f"{architectures[0]} ({model_type})" if architectures else model_type


def check_supported(config: Any, max_model_len: int) -> None:
    """Refuse a model configuration this engine would serve wrongly.

    Args:
        config: the model's transformers configuration (``model.config``).
        max_model_len: the context length the engine will serve (tokens).

    Raises:
        EngineConfigError: the architecture and the reason, with the flag that helps
            where one does (``--max-model-len`` for a sliding window).
    """
    name = describe(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        raise EngineConfigError(
            f"{name} is not supported: its outputs have not been verified against "
            f"transformers (supported: {', '.join(sorted(VERIFIED_MODEL_TYPES))})"
        )
    window = _binding_window(config, max_model_len)
    if window is not None:
        raise EngineConfigError(
            f"{name} uses sliding-window attention ({window} tokens), which this engine "
            f"does not implement; serve it with --max-model-len {window} or less, where "
            "the window never binds"
        )
    for field, what in (
        ("attn_logit_softcapping", "attention logit softcapping"),
        ("final_logit_softcapping", "final logit softcapping"),
    ):
        if getattr(config, field, None) is not None:
            raise EngineConfigError(f"{name} is not supported: {what} ({field}) is not implemented")
    for field in ("logits_scaling", "logit_scale"):
        value = getattr(config, field, None)
        if value is not None and value != 1:
            raise EngineConfigError(
                f"{name} is not supported: its logits are scaled ({field}={value}), which "
                "this engine does not apply"
            )


def _binding_window(config: Any, max_model_len: int) -> int | None:
    """The sliding window of some layer when it is narrower than the context, else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise EngineConfigError(
                f"{describe(config)} is not supported: layer types {other} are not implemented"
            )
        uses_window = "sliding_attention" in layer_types
    else:
        uses_window = getattr(config, "use_sliding_window", True) is not False
    if uses_window and window is not None and window < max_model_len:
        return int(window)
    return None
