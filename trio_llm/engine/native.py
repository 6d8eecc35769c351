"""The engine's own forward pass for Llama-family decoders (``--model-impl``).

transformers' decoder spends a batch-1 decode step mostly in Python: 30 layers of module
calls, keyword plumbing and separate q/k/v and gate/up projections. `NativeLlama` runs the
same arithmetic with the same weights in one loop of plain tensor operations:

- q, k and v come from one product with their weights concatenated (``[q; k; v]``), gate
  and up from another (``[gate; up]``); the original modules' weights become views of
  the concatenated tensors, so no weight is held twice;
- the rotary embedding is the model's own module, called once per step;
- attention is `trio_llm.engine.attention.paged_attention`, as on the transformers path;
- RMSNorm, SiLU, the residual additions and the rotary arithmetic are the operations
  transformers' Llama code performs, in its order and dtypes.

In float32 its hidden states equal transformers' bit for bit on the CPUs tried (a
concatenated product gives each output column the same sum); the conformance suite runs
both paths against ``generate()``. With ``--quantization`` the concatenated projections
(and the output projection, in the model runner) become `QuantizedLinear` layers, and
on the CPU the layer's small pieces run as the native kernels' fused operators where they
loaded (`_fused_call`: the residual add with the RMSNorm after it, the rotary embedding of
q and k in place, SiLU with the gating): about 20 fewer operator calls a layer, equal to
the unfused ones up to float32 rounding, so float32 weights keep the unfused path.

`native_decoder` decides: only a ``LlamaForCausalLM`` whose modules are exactly
transformers' Llama classes, with SiLU, qualifies; anything else runs transformers' code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import rotate_half

from trio_llm.config import MODEL_IMPLS
from trio_llm.engine import kernels
from trio_llm.engine.attention import paged_attention
from trio_llm.engine.attention_metadata import PagedAttentionMetadata, current_step
from trio_llm.engine.gguf_linear import GGUFLinear, GGUFWeights
from trio_llm.engine.lora import Layout, LoraProduct, current_lora, native_layout
from trio_llm.engine.quantization import QuantizedLinear, can_quantize

logger = logging.getLogger(__name__)

_LLAMA_CLASSES = {
    "layer": "LlamaDecoderLayer",
    "attention": "LlamaAttention",
    "mlp": "LlamaMLP",
    "norm": "LlamaRMSNorm",
    "decoder": "LlamaModel",
}


def _projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One product ``x @ W.T (+ b)``: float weights, or int8 / int4 ones through
    `QuantizedLinear`'s kernel (its ``forward`` called directly: no module dispatch)."""
    if quantization is not None and can_quantize(weight, quantization):
        return QuantizedLinear.from_weight(weight, bias, quantization).forward
    return functools.partial(F.linear, weight=weight, bias=bias)


def _concat(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``modules`` along the output channels and
    make each module's parameters views of the result (shared storage)."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach() if b is not None else weight.new_zeros(m.out_features)
                for m, b in zip(modules, biases, strict=True)
            ]
        )
    start = 0
    for module in modules:
        end = start + module.out_features
        module.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if module.bias is not None and bias is not None:
            module.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class _Layer:
    """One decoder layer's weights, concatenated."""

    def __init__(
        self,
        layer: torch.nn.Module,
        quantization: str | None,
        gguf: dict[str, GGUFLinear] | None = None,
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn  # paged_attention reads its layer_idx
        self.scaling = attn.scaling
        self.head_dim = attn.head_dim
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.num_heads = self.q_size // self.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        if gguf is not None:
            # The GGUF file's own blocks (`trio_llm.engine.gguf_linear`); biases, where the
            # model has them, from its float parameters.
            for role, module in zip(gguf, _projections(layer), strict=True):
                gguf[role].bias = None if module.bias is None else module.bias.detach()
            self.qkv = GGUFLinear.concat([gguf["q"], gguf["k"], gguf["v"]])
            self.o = gguf["o"].packed().forward
            self.gate_up = GGUFLinear.concat([gguf["gate"], gguf["up"]])
            self.down = gguf["down"].packed().forward
            self.products = _gguf_products([self.qkv, self.o, self.gate_up, self.down])
            return
        #: ``(blocks, type)`` of the four products where one call runs the layer
        #: (`NativeLlama._one_call`): GGUF products without bias; else None.
        self.products: list[tuple[torch.Tensor, int]] | None = None
        self.qkv = _projection(*_concat([attn.q_proj, attn.k_proj, attn.v_proj]), quantization)
        self.o = _projection(attn.o_proj.weight, attn.o_proj.bias, quantization)
        self.gate_up = _projection(*_concat([mlp.gate_proj, mlp.up_proj]), quantization)
        self.down = _projection(mlp.down_proj.weight, mlp.down_proj.bias, quantization)


def _gguf_products(products: list[Callable]) -> list[tuple[torch.Tensor, int]] | None:
    """Each product's ``(blocks, type)`` where all are one `GGUFLinear`'s forward without
    bias (not a concatenation of mixed types), else None."""
    found = []
    for product in products:
        layer = getattr(product, "__self__", None)
        if not isinstance(layer, GGUFLinear) or layer.bias is not None:
            return None
        found.append((layer.blocks, layer.kernel_type))
    return found


def _decode_step(hidden: torch.Tensor) -> PagedAttentionMetadata | None:
    """The step's metadata where every token of ``hidden`` (float32 ``[1, T, ...]``)
    decodes over the native attention kernel, else None."""
    paged = current_step()
    if not isinstance(paged, PagedAttentionMetadata) or hidden.dtype != torch.float32:
        return None
    decode_only = paged.num_decode == hidden.shape[1] and not paged.prefills
    if not decode_only or paged.prefill_batch is not None or not paged.native_attention:
        return None
    return paged


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A Llama decoder layer's seven projection modules."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32 torch's fused ``rms_norm`` (the same
    values, bit for bit, in one call), else the module itself (it rounds to the model's
    dtype before the weight multiplies)."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(hidden)


class NativeLlama:
    """The decoder of a Llama-family model as plain tensor operations (module docstring).

    Call it inside `trio_llm.engine.attention_metadata.step_metadata`, like the decoder it
    replaces.

    Args:
        model: a ``LlamaForCausalLM`` that `native_decoder` accepted.
        quantization: ``int8``, ``int4``, ``gguf`` (with ``gguf``) or None (float weights).
        gguf: the GGUF file's blocks for ``quantization="gguf"``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        quantization: str | None = None,
        gguf: GGUFWeights | None = None,
    ) -> None:
        decoder = model.get_decoder()
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm
        if quantization == "gguf" and gguf is None:
            raise ValueError("quantization 'gguf' needs the GGUF file's weights")
        self.layers = [
            _Layer(layer, quantization, gguf.layers[i] if gguf is not None else None)
            for i, layer in enumerate(decoder.layers)
        ]
        #: The fused layer pieces (module docstring): quantized weights, on the CPU, where
        #: the native kernels loaded.
        self.fused = (
            quantization is not None
            and self.norm.weight.device.type == "cpu"
            and kernels.load().loaded
        )
        #: A decode-only step runs each GGUF layer in one call (`_one_call`); tests turn it
        #: off to compare with the operator-by-operator loop.
        self.one_call = self.fused and quantization == "gguf"
        if quantization is not None:
            # The transformers modules' float weights are no longer read by any step:
            # free them (the probe at start-up ran before).
            for layer in decoder.layers:
                for module in _projections(layer):
                    module.weight = torch.nn.Parameter(module.weight.new_empty(0, 0))

    def wrap_lora(self) -> Layout:
        """Add the step's LoRA terms to every product (`trio_llm.engine.lora`); returns
        the products' layout."""
        for index, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, LoraProduct(getattr(layer, name), (index, name)))
        first = self.layers[0]
        return native_layout(first.q_size, first.kv_size, first.intermediate)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states of a packed step.

        Args:
            input_ids: int64 ``[1, T]`` token ids.
            position_ids: int64 ``[1, T]`` positions.

        Returns:
            ``[T, hidden_size]`` in the model's dtype, after the final norm.
        """
        hidden = self.embed_tokens(input_ids)  # [1, T, hidden]
        cos, sin = self.rotary_emb(hidden, position_ids)
        if self.fused:
            return self._fused_call(hidden, cos, sin)
        cos = cos.unsqueeze(1)  # [1, 1, T, D]
        sin = sin.unsqueeze(1)
        num_tokens = input_ids.shape[1]
        for layer in self.layers:
            residual = hidden
            x = _rms_norm(layer.input_norm, hidden)
            qkv = layer.qkv(x)
            d = layer.head_dim
            qk_size = layer.q_size + layer.kv_size
            # The rotary embedding of q and k in one pass over both (elementwise: the
            # same values as transformers' two).
            qk = qkv[..., :qk_size].view(1, num_tokens, -1, d).transpose(1, 2)
            qk = (qk * cos) + (rotate_half(qk) * sin)
            q = qk[:, : layer.num_heads]
            k = qk[:, layer.num_heads :]
            v = qkv[..., qk_size:].view(1, num_tokens, -1, d).transpose(1, 2)
            attn, _ = paged_attention(layer.attention, q, k, v, None, scaling=layer.scaling)
            hidden = residual + layer.o(attn.reshape(1, num_tokens, -1))
            residual = hidden
            x = _rms_norm(layer.post_norm, hidden)
            gate_up = layer.gate_up(x)
            x = F.silu(gate_up[..., : layer.intermediate]) * gate_up[..., layer.intermediate :]
            hidden = residual + layer.down(x)
        return _rms_norm(self.norm, hidden)[0]

    def _fused_call(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`__call__`'s layers with the fused pieces (``torch.ops.trio_llm``).

        Args:
            hidden: ``[1, T, hidden_size]`` embeddings (updated in place).
            cos, sin: ``[1, T, head_dim]`` rotary tables.
        """
        ops = torch.ops.trio_llm
        num_tokens = hidden.shape[1]
        cos, sin = cos.contiguous(), sin.contiguous()
        delta = None
        one_call = self.one_call and current_lora() is None  # adapters: layer by layer
        step = _decode_step(hidden) if one_call else None
        for layer in self.layers:
            if step is not None and layer.products is not None:
                delta = self._one_call(layer, step, hidden, delta, cos, sin)
                continue
            norm = layer.input_norm
            x = ops.add_rms_norm_(hidden, delta, norm.weight, norm.variance_epsilon)
            qkv = layer.qkv(x).contiguous()
            d = layer.head_dim
            qk_heads = (layer.q_size + layer.kv_size) // d
            ops.rotary_(qkv, cos, sin, qk_heads, d)
            heads = qkv.view(1, num_tokens, -1, d).transpose(1, 2)  # [1, H + 2 H_kv, T, D]
            q = heads[:, : layer.num_heads]
            k = heads[:, layer.num_heads : qk_heads]
            v = heads[:, qk_heads:]
            attn, _ = paged_attention(layer.attention, q, k, v, None, scaling=layer.scaling)
            delta = layer.o(attn.reshape(1, num_tokens, -1))
            norm = layer.post_norm
            x = ops.add_rms_norm_(hidden, delta, norm.weight, norm.variance_epsilon)
            delta = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        norm = self.norm
        return ops.add_rms_norm_(hidden, delta, norm.weight, norm.variance_epsilon)[0]

    @staticmethod
    def _one_call(
        layer: _Layer,
        step: PagedAttentionMetadata,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """``layer`` of a decode-only step in one call (``decoder_layer_decode``: the
        operators of `_fused_call`'s loop, in its order): ``hidden`` gets the residual
        ``delta``; returns the layer's output delta ``[1, T, hidden_size]``."""
        cache = step.kv_cache
        index = layer.attention.layer_idx
        group = cache.group_of[index]
        (qkv, qkv_type), (o, o_type), (gate_up, gate_up_type), (down, down_type) = layer.products
        scale = layer.head_dim**-0.5 if layer.scaling is None else layer.scaling
        return torch.ops.trio_llm.decoder_layer_decode(
            hidden,
            delta,
            layer.input_norm.weight,
            layer.post_norm.weight,
            layer.input_norm.variance_epsilon,
            qkv,
            qkv_type,
            o,
            o_type,
            gate_up,
            gate_up_type,
            down,
            down_type,
            cos,
            sin,
            layer.num_heads,
            layer.kv_size // layer.head_dim,
            layer.head_dim,
            cache.keys[index],
            cache.values[index],
            step.slot_mapping[group],
            step.decode_blocks[group],
            step.decode_lengths,
            cache.block_size,
            float(scale),
        )


def native_unsupported(model: torch.nn.Module) -> str | None:
    """Why `NativeLlama` cannot run ``model``, or None when it can."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} has no native implementation"
    decoder = model.get_decoder()
    if type(decoder).__name__ != _LLAMA_CLASSES["decoder"]:
        return f"its decoder is {type(decoder).__name__}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (native: silu)"
    if type(decoder.norm).__name__ != _LLAMA_CLASSES["norm"]:
        return f"its final norm is {type(decoder.norm).__name__}"
    for layer in decoder.layers:
        found = {
            "layer": type(layer).__name__,
            "attention": type(layer.self_attn).__name__,
            "mlp": type(layer.mlp).__name__,
            "norm": type(layer.input_layernorm).__name__,
        }
        if type(layer.post_attention_layernorm).__name__ != _LLAMA_CLASSES["norm"]:
            return "a layer's post-attention norm is not LlamaRMSNorm"
        for role, name in found.items():
            if name != _LLAMA_CLASSES[role]:
                return f"a layer's {role} is {name}"
        for linear in _projections(layer):
            if type(linear) is not torch.nn.Linear:
                return f"a projection is {type(linear).__name__}, not Linear"
    return None


def native_decoder(
    model: torch.nn.Module,
    model_impl: str = "auto",
    quantization: str | None = None,
    gguf: GGUFWeights | None = None,
) -> NativeLlama | None:
    """The native decoder for ``model``, or None to run transformers' modules.

    Args:
        model: the loaded causal LM.
        model_impl: one of `MODEL_IMPLS`.
        quantization: ``int8``, ``int4``, ``gguf`` or None.
        gguf: the GGUF file's blocks, for ``gguf`` (which needs the native decoder).

    Raises:
        ValueError: ``model_impl`` is ``trio_llm`` (or ``quantization`` is ``gguf``) and
            the model does not qualify (the reason is in the message), or an unknown
            ``model_impl``.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    if model_impl == "transformers":
        if quantization == "gguf":
            raise ValueError("--quantization gguf runs on the native forward pass only")
        return None
    reason = native_unsupported(model)
    if reason is not None:
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf needs the native forward pass: {reason}")
        if model_impl == "trio_llm":
            raise ValueError(f"--model-impl trio_llm: {reason}")
        logger.info("running transformers' modules: %s", reason)
        return None
    return NativeLlama(model, quantization, gguf)
