"""Which models the engine serves correctly, checked before it reports ready.

The engine runs transformers' own model code with its paged attention plugged in
(`trio_llm.engine.attention`) and computes logits through the model's own head
(`trio_llm.engine.model_runner`). Three checks refuse what it would serve wrongly, each
with a message naming the architecture and why:

- `check_supported` (configuration only): encoder-decoder models, families not verified
  against transformers' ``generate()`` by the conformance suite (tests/unit/
  test_conformance.py), and layer types other than full and sliding-window attention;
  `check_context`: a context at which the rotary embedding would depend on the batch;
- `trio_llm.engine.attention_probe.probe_layers` (one forward pass of one token): layers whose
  attention does not go through transformers' attention interface (recurrent or hybrid
  layers), attention sinks, bidirectional attention, arguments it does not implement;
- the model runner: a head path that does not return one row of logits per hidden state.
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
        "gemma2",
        "gpt_neox",
        "stablelm",
        "phi",
        "mixtral",
        "olmo",
        "gpt2",
    }
)


def describe(config: Any) -> str:
    """The architecture's name for messages, e.g. ``"MistralForCausalLM (mistral)"``."""
    model_type = getattr(config, "model_type", None) or "unknown"
    architectures = getattr(config, "architectures", None) or []
    return f"{architectures[0]} ({model_type})" if architectures else model_type


def check_supported(config: Any) -> None:
    """Refuse a model configuration this engine would serve wrongly (before any probing).

    Args:
        config: the model's transformers configuration (``model.config``).

    Raises:
        EngineConfigError: the architecture and the reason.
    """
    name = describe(config)
    if getattr(config, "is_encoder_decoder", False):
        raise EngineConfigError(
            f"{name} is not supported: encoder-decoder models are not implemented"
        )
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        raise EngineConfigError(
            f"{name} is not supported: its outputs have not been verified against "
            f"transformers (supported: {', '.join(sorted(VERIFIED_MODEL_TYPES))})"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise EngineConfigError(f"{name} is not supported: layer types {other} are not implemented")


def check_context(config: Any, max_model_len: int) -> None:
    """Refuse a context length at which the model's rotary embedding would depend on the
    batch: transformers' ``longrope`` switches every sequence of a forward pass to its long
    factors once the pass's longest sequence exceeds ``original_max_position_embeddings``,
    so a request's output would depend on the others batched with it.

    Raises:
        EngineConfigError: the architecture, the reason and the ``--max-model-len`` that
            serves it exactly.
    """
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return
    per_layer_type = [p for p in parameters.values() if isinstance(p, dict)]
    for rope in per_layer_type or [parameters]:
        if rope.get("rope_type", rope.get("type")) != "longrope":
            continue
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if original is not None and max_model_len > original:
            raise EngineConfigError(
                f"{describe(config)} is not supported at max_model_len {max_model_len}: its "
                f"longrope embedding changes for a whole batch once a sequence passes "
                f"{original} tokens; serve it with --max-model-len {original} or less"
            )
