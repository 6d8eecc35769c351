"""Tiny random-weight models of many transformers architectures, for conformance tests.

Each `Architecture` builds a float32 model of the real transformers class (2-3 layers,
hidden size 64, vocabulary 512) whose configuration turns on the features that make the
family different from Llama: sliding windows narrower than the test prompts, softcapping,
logit scaling, an output bias, partial rotary embeddings, and so on (``exercises`` says
which). Weights come from a fixed seed and are redrawn with a large standard deviation
after transformers' own initialisation, which leaves norms at one and biases at zero:
here every bias, norm weight, attention sink and output bias is random too, so a code
path that drops one of them changes the output.

`build_model` returns the same model object for a name for the whole session, with
transformers' ``eager`` attention: the reference. `engine_copy` gives an independent copy
with the engine's attention plugged in.

``refused`` architectures are the ones the engine must refuse at start-up (recurrent
state, attention outside transformers' ``AttentionInterface``, attention sinks, rotary
frequencies that depend on the batch, ...):
their weights are left as transformers initialised them.
"""

from __future__ import annotations

import copy
import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from tests.support.tiny_model import TINY_SHAPE, TOKENIZER_FILES

VOCAB_SIZE = 512
MAX_POSITIONS = 256
#: Every verified model's sliding window (where it has one): far narrower than the prompts.
WINDOW = 8
#: Standard deviation of every redrawn weight matrix (transformers uses about 0.02).
MATRIX_STD = 0.25
#: Standard deviation of the noise added to every 1-D parameter (norm weights, biases).
VECTOR_STD = 0.2

#: Shared by most families (names as transformers' Llama-like configurations spell them).
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    **TINY_SHAPE,
    "max_position_embeddings": MAX_POSITIONS,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Architecture:
    """One tiny model to check.

    Attributes:
        name: test id (a model_type, or a model_type and a variant).
        model_type: transformers' ``model_type``.
        fields: configuration fields on top of `COMMON` (when ``common``).
        exercises: what the configuration turns on, in one line.
        refused: the engine must refuse it at start-up.
        common: start from `COMMON` (False for configurations with other field names).
        seed: of the weights; another one if a reference turns out ambiguous (two tokens
            within `tests.unit.engine.test_conformance.MIN_MARGIN` of each other).
    """

    name: str
    model_type: str
    fields: dict[str, Any]
    exercises: str
    refused: bool = False
    common: bool = True
    seed: int = 0

    def config(self) -> PretrainedConfig:
        fields = {**COMMON, **self.fields} if self.common else dict(self.fields)
        return AutoConfig.for_model(self.model_type, **fields)


def _arch(name: str, model_type: str, exercises: str, **fields: Any) -> Architecture:
    return Architecture(name, model_type, fields, exercises)


def _refused(
    name: str, model_type: str, exercises: str, *, common: bool = True, **fields: Any
) -> Architecture:
    return Architecture(name, model_type, fields, exercises, refused=True, common=common)


_GEMMA = {"head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
#: Gemma 2 and 3 tie their embeddings too, but tied random weights behind sandwich norms make
#: the model echo its input token forever (the embedding dominates the residual stream).
_GEMMA_UNTIED = {**_GEMMA, "tie_word_embeddings": False}

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        _arch(
            "llama",
            "llama",
            "GQA 4/2 heads, RoPE, SwiGLU, RMSNorm, tied embeddings",
            tie_word_embeddings=True,
        ),
        _arch(
            "llama_dynamic_rope",
            "llama",
            "dynamic NTK rope factor 4: exact, as it only binds past max_position_embeddings",
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        ),
        _arch(
            "mistral",
            "mistral",
            f"sliding window {WINDOW} on every layer, GQA, untied output",
            sliding_window=WINDOW,
        ),
        _arch(
            "qwen2",
            "qwen2",
            "q/k/v biases; a sliding_window that use_sliding_window=False turns off",
            sliding_window=WINDOW,
            use_sliding_window=False,
        ),
        _arch(
            "qwen2_swa",
            "qwen2",
            f"q/k/v biases; window {WINDOW} from layer max_window_layers=1 on (full, sliding)",
            sliding_window=WINDOW,
            use_sliding_window=True,
            max_window_layers=1,
        ),
        _arch(
            "qwen3",
            "qwen3",
            "per-head q/k RMSNorm, head_dim 32 != hidden/heads",
            head_dim=32,
        ),
        _arch(
            "qwen3_swa",
            "qwen3",
            f"qwen3 with window {WINDOW} on layers >= 1 (max_window_layers=1)",
            head_dim=32,
            sliding_window=WINDOW,
            use_sliding_window=True,
            max_window_layers=1,
        ),
        _arch(
            "qwen3_moe",
            "qwen3_moe",
            "top-2 of 4 experts (norm_topk_prob), layer 1 dense (mlp_only_layers), q/k norm",
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        _arch(
            "mixtral",
            "mixtral",
            f"top-2 of 4 experts (block-sparse MoE), sliding window {WINDOW}",
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
        ),
        _arch(
            "gemma",
            "gemma",
            "MQA (1 KV head), head_dim 32, sqrt(hidden) embedding scale, (1 + w) RMSNorm",
            num_key_value_heads=1,
            **_GEMMA,
        ),
        _arch(
            "gemma2",
            "gemma2",
            f"window {WINDOW} on layer 0, attention softcap 5, final softcap 4, "
            "query_pre_attn_scalar 24, sandwich norms, untied output",
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=4.0,
            query_pre_attn_scalar=24,
            **_GEMMA_UNTIED,
        ),
        _arch(
            "gemma3_text",
            "gemma3_text",
            f"layer_types sliding/sliding/full with window {WINDOW}, local rope theta 10k vs "
            "global 1M, query_pre_attn_scalar 24, q/k norm, untied output",
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            **_GEMMA_UNTIED,
        ),
        _arch(
            "phi3",
            "phi3",
            "fused qkv and gate_up projections, partial rotary 0.5",
            partial_rotary_factor=0.5,
        ),
        _arch(
            "phi3_swa",
            "phi3",
            f"phi3 with sliding window {WINDOW} on every layer",
            sliding_window=WINDOW,
        ),
        _arch(
            "phi",
            "phi",
            "output projection bias, partial rotary 0.5, parallel attention+MLP, LayerNorm, "
            "dense biases, q/k LayerNorm",
            num_key_value_heads=4,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
        ),
        _arch(
            "olmo",
            "olmo",
            "non-parametric LayerNorm, clip_qkv 0.5",
            clip_qkv=0.5,
        ),
        _arch(
            "olmo2",
            "olmo2",
            "q/k RMSNorm over all heads, post-attention/post-MLP norms only",
        ),
        _arch(
            "granite",
            "granite",
            "logits_scaling 4, embedding_multiplier 3, residual_multiplier 0.5, "
            "attention_multiplier 0.1",
            logits_scaling=4.0,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
        ),
        _arch(
            "cohere",
            "cohere",
            "logit_scale 0.25, interleaved rotary, parallel residual, bias-free LayerNorm, "
            "per-head q/k norm",
            logit_scale=0.25,
            use_qk_norm=True,
            tie_word_embeddings=True,
        ),
        _arch(
            "starcoder2",
            "starcoder2",
            f"sliding window {WINDOW}, biases everywhere, LayerNorm, non-gated GELU MLP",
            sliding_window=WINDOW,
        ),
        _arch(
            "gpt_neox",
            "gpt_neox",
            "fused per-head qkv, partial rotary 0.25, parallel residual, attention biases, "
            "MHA (no num_key_value_heads)",
            num_key_value_heads=None,
        ),
        _arch(
            "stablelm",
            "stablelm",
            "partial rotary 0.25, q/k/v biases, per-head q/k LayerNorm, GQA",
            use_qkv_bias=True,
            qk_layernorm=True,
        ),
        _arch(
            "gpt2",
            "gpt2",
            "learned absolute positions, Conv1D, scale_attn_by_inverse_layer_idx, tied output",
            num_key_value_heads=None,
            scale_attn_by_inverse_layer_idx=True,
            tie_word_embeddings=True,
        ),
        # Falcon had its own attention code until transformers 5.25 moved it onto the
        # interface; Bloom's (ALiBi, fused QKV) still bypasses it.
        _refused(
            "bloom",
            "bloom",
            "own attention code (no AttentionInterface): never sees the paged cache",
        ),
        _refused(
            "gpt_oss",
            "gpt_oss",
            "attention sinks (s_aux) passed to the attention function, MoE, sliding layers",
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
        ),
        _refused(
            "mamba",
            "mamba",
            "recurrent state space model: no attention, no max_position_embeddings",
            common=False,
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=2,
        ),
        _refused(
            "jamba",
            "jamba",
            "hybrid: attention (through AttentionInterface) interleaved with Mamba layers",
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            num_experts=2,
        ),
        _refused(
            "bart",
            "bart",
            "an encoder-decoder's decoder (BartForCausalLM): learned positions offset by "
            "2, cross-attention blocks",
            common=False,
            vocab_size=VOCAB_SIZE,
            d_model=64,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=MAX_POSITIONS,
        ),
        _refused(
            "phi3_longrope",
            "phi3",
            "longrope past original_max_position_embeddings=32: short or long factors for "
            "the whole forward pass by its longest sequence (batch-dependent)",
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 4 + [1.5] * 4,
                "long_factor": [2.0] * 4 + [8.0] * 4,
                "original_max_position_embeddings": 32,
            },
            original_max_position_embeddings=32,
        ),
    ]
}

VERIFIED = [name for name, arch in ARCHITECTURES.items() if not arch.refused]
REFUSED = [name for name, arch in ARCHITECTURES.items() if arch.refused]


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Every matrix ~ N(0, MATRIX_STD); every vector (norm weight, bias, sink) plus noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.dim() >= 2:
                param.copy_(noise * MATRIX_STD)
            else:
                param.add_(noise * VECTOR_STD)


@functools.cache
def build_model(name: str, vocab_size: int = VOCAB_SIZE) -> PreTrainedModel:
    """The tiny model ``name`` (float32, eval mode, ``eager`` attention), built once.

    Callers must not modify it: `engine_copy` gives a copy for the engine. ``vocab_size``
    other than `VOCAB_SIZE`: to pair it with a real tokenizer (to be served).
    """
    arch = ARCHITECTURES[name]
    config = arch.config()
    config.vocab_size = vocab_size
    config._attn_implementation = "eager"
    torch.manual_seed(arch.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not arch.refused:
        _redraw(model, arch.seed)
    # As a checkpoint's config.json says (the engine names the architecture from it).
    model.config.architectures = [type(model).__name__]
    model.eval()
    model.requires_grad_(False)
    return model


def engine_copy(model: PreTrainedModel, attn_implementation: str) -> PreTrainedModel:
    """An independent copy of ``model`` with another attention implementation."""
    clone = copy.deepcopy(model)
    clone.set_attn_implementation(attn_implementation)
    return clone


def save_for_serving(name: str, path: Path, tokenizer_dir: Path, vocab_size: int) -> Path:
    """Write the tiny model ``name`` with the tokenizer of ``tokenizer_dir`` (whose
    vocabulary has ``vocab_size`` tokens) as a folder ``trio-llm serve --model`` loads."""
    build_model(name, vocab_size).save_pretrained(path)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, path / file)
    return path
