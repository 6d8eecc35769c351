"""Weight-only quantized linear layers made at load time (``--quantization``).

Two modes, both through torch's own CPU kernels:

- ``int8``: one int8 weight per element and one scale per output channel (symmetric,
  ``w ≈ q * scale``), multiplied by ``torch.ops.aten._weight_int8pack_mm``;
- ``int4``: 4-bit weights in groups of `INT4_GROUP_SIZE` input channels, each group with
  its own scale and minimum (asymmetric, ``w ≈ q * scale + min``, ``q`` in 0..15),
  multiplied by ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

Both kernels read bfloat16 activations (their float32 paths are unvectorised, 5-30x
slower): a float32 model's activations are rounded to bfloat16 on the way in and the
bfloat16 result is turned back to the model's dtype. Activations keep the model's dtype
everywhere else, and so does the KV cache unless ``--kv-cache-dtype`` names another.
Quantization changes the outputs: the model's float32 weights stay the reference
(`bench/quantization.py` reports perplexity and greedy agreement per mode).

The kernels pay off when a step streams the weights from memory (a few sequences per
step: 4x or 8x fewer bytes than float32); at large batches they compute more slowly than
float32 GEMMs (docs/benchmarks.md, "Turn of the engine").
"""

from __future__ import annotations

import torch

#: The modes `QuantizedLinear` makes (``gguf`` is `trio_llm.engine.gguf_linear`'s).
WEIGHT_METHODS = ("int8", "int4")

#: Input channels sharing one int4 scale and minimum.
INT4_GROUP_SIZE = 32

#: The int4 kernel packs output channels in tiles of this many.
INT4_N_MULTIPLE = 16


def can_quantize(weight: torch.Tensor, method: str) -> bool:
    """Whether a ``[out_features, in_features]`` weight fits ``method``'s kernel."""
    out_features, in_features = weight.shape
    if method == "int4":
        return in_features % INT4_GROUP_SIZE == 0 and out_features % INT4_N_MULTIPLE == 0
    return True


class QuantizedLinear(torch.nn.Module):
    """A bias-optional linear layer with int8 or int4 weights (see the module docstring).

    Build it with `from_weight`. ``forward(x)`` takes ``[..., in_features]`` activations
    of any float dtype and returns ``[..., out_features]`` in the same dtype.

    Attributes:
        method: ``int8`` or ``int4``.
        in_features, out_features: the layer's shape.
    """

    def __init__(
        self,
        method: str,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = bias

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, method: str
    ) -> QuantizedLinear:
        """Quantize a float ``[out_features, in_features]`` weight.

        Args:
            weight: the layer's weight (any float dtype, on the CPU).
            bias: ``[out_features]`` or None; kept in its dtype.
            method: ``int8`` or ``int4``.

        Raises:
            ValueError: an unknown method, or a shape the method's kernel cannot take
                (`can_quantize`).
        """
        if method not in WEIGHT_METHODS:
            raise ValueError(f"quantization must be one of {WEIGHT_METHODS}, got {method!r}")
        if not can_quantize(weight, method):
            raise ValueError(f"a {tuple(weight.shape)} weight cannot be quantized to {method}")
        out_features, in_features = weight.shape
        w = weight.detach().float()
        if method == "int8":
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            scales = scale.to(torch.bfloat16)
        else:
            groups = w.view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
            low = groups.amin(dim=-1)
            scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)
            q = q.to(torch.int32).view(out_features, in_features)
            q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # The kernel computes (q - 8) * scale + zero: zero = low + 8 * scale.
            # [in_features / group, out_features, 2]
            scales = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)
            scales = scales.contiguous().to(torch.bfloat16)
        return cls(method, in_features, out_features, q, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.method == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.qweight, INT4_GROUP_SIZE, self.scales
            )
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return f"{self.method}, in_features={self.in_features}, out_features={self.out_features}"

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight this layer multiplies by
        (for tests and quality reports)."""
        columns = self(torch.eye(self.in_features))  # [in, out]: row i is W[:, i] + bias
        if self.bias is not None:
            columns = columns - self.bias
        return columns.t().float()


def quantize_linears(module: torch.nn.Module, method: str) -> tuple[int, int]:
    """Replace every ``torch.nn.Linear`` inside ``module`` (in place) whose shape fits
    ``method`` by a `QuantizedLinear`.

    Returns:
        ``(quantized, kept)``: how many layers were replaced and how many kept their
        float weights because their shape does not fit the kernel.
    """
    quantized = kept = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            if not can_quantize(child.weight, method):
                kept += 1
                continue
            setattr(parent, name, QuantizedLinear.from_weight(child.weight, child.bias, method))
            quantized += 1
    return quantized, kept
