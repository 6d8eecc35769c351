"""GGUF-native linear layers (``--quantization gguf``): a GGUF file's own quantized blocks,
multiplied by the native kernel ``torch.ops.trio_llm.gguf_matmul``.

No de-quantized copy of a weight is kept: a `GGUFLinear` holds the tensor's raw blocks
(uint8 ``[out_features, row_bytes]``, one row of ``in_features / block_values`` blocks
per output channel, exactly the bytes of the file) and each product quantizes the
activations to int8 per 32-value block (one float32 scale each) and takes integer dot
products against the blocks (`trio_llm/engine/kernels/csrc/gguf_matmul.cpp`). These are the
weights llama.cpp multiplies, with its kind of arithmetic; the result differs from the
de-quantized float product only by the activations' int8 rounding (about 0.5 % of the
output's scale; `tests/unit/engine/test_gguf_linear.py` states the bounds).

`GGUFWeights` reads a Llama GGUF file's decoder projections and output head for
`trio_llm.engine.native.NativeLlama`. llama.cpp's converter permutes the rows of
``attn_q`` / ``attn_k`` (its rotary convention pairs neighbouring channels); transformers
un-permutes them on load, and so does `GGUFWeights` (a permutation of whole rows, so of
whole rows of blocks: the raw bytes move, nothing is de-quantized). At load the layer-0
projections are checked against the float weights transformers loaded from the same file:
a file that does not match the model is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trio_llm.engine import kernels
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError
from trio_llm.model_files.weight_headers import (
    GGUFHeader,
    GGUFTensor,
    WeightFileError,
    read_gguf_header,
)

logger = logging.getLogger(__name__)

#: GGML type id -> (name, values per block, bytes per block) the kernel multiplies.
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
}

#: The decoder projections of a Llama layer: GGUF tensor name part -> NativeLlama role.
LLAMA_PROJECTIONS = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def kernel_available() -> str | None:
    """None when ``torch.ops.trio_llm.gguf_matmul`` is loaded, else why not."""
    status = kernels.load()
    if not status.loaded:
        return f"the native kernels are not loaded ({status.detail})"
    if not hasattr(torch.ops.trio_llm, "gguf_matmul"):
        return "the native kernel library has no gguf_matmul"
    return None


class GGUFLinear(torch.nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` a GGUF tensor's raw quantized blocks.

    Args:
        blocks: uint8 ``[out_features, row_bytes]``, contiguous: row ``n`` is the
            ``in_features / block_values`` blocks of output channel ``n``.
        ggml_type: the GGML type id (`GGUF_TYPES`: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
        in_features: ``K``; a multiple of the type's block size.
        bias: float ``[out_features]`` or None.

    ``forward(x)`` takes float32 or bfloat16 ``[..., in_features]`` on the CPU and returns
    ``[..., out_features]`` in ``x``'s dtype (float32 when ``out_dtype`` is given as such).

    `packed` returns the same layer with its blocks repacked for the AVX-512 kernels
    (``gguf_repack``: 16 output channels interleaved) where the native library packs the
    type (Q4_0, Q4_1, Q8_0 on a CPU with AVX-512 VNNI).

    Raises:
        ValueError: an unsupported type, or blocks whose shape does not fit ``in_features``.
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        ggml_type: int,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if ggml_type not in GGUF_TYPES:
            names = ", ".join(name for name, _, _ in GGUF_TYPES.values())
            raise ValueError(f"GGML type {ggml_type} has no kernel (supported: {names})")
        name, values, nbytes = GGUF_TYPES[ggml_type]
        if in_features % values:
            raise ValueError(f"{name}: in_features {in_features} is not a multiple of {values}")
        row_bytes = in_features // values * nbytes
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(
                f"{name} blocks for in_features {in_features} must be uint8 [N, {row_bytes}], "
                f"got {blocks.dtype} {tuple(blocks.shape)}"
            )
        self.ggml_type = ggml_type
        #: The type id the kernel is called with: ``ggml_type``, or its packed id.
        self.kernel_type = ggml_type
        self.type_name = name
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = bias

    def packed(self) -> GGUFLinear:
        """This layer with its blocks repacked (``gguf_repack``) where the native library
        packs its type and ``out_features`` is a multiple of 16, else itself. A packed
        layer multiplies the same numbers (the products equal the unpacked kernel's up to
        float32 summation order) and has no `dequantized`."""
        ops = torch.ops.trio_llm
        kernel_type = ops.gguf_packed_type(self.ggml_type)
        if kernel_type < 0 or self.out_features % 16:
            return self
        blocks = ops.gguf_repack(self.blocks, self.ggml_type, self.in_features)
        layer = GGUFLinear(self.blocks[:0], self.ggml_type, self.in_features, self.bias)
        layer.blocks = blocks
        layer.kernel_type = kernel_type
        layer.out_features = self.out_features
        return layer

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` (``out_dtype``, else ``x``'s)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        y = torch.ops.trio_llm.gguf_matmul(x2, self.blocks, self.kernel_type)
        if self.bias is not None:
            y = y + self.bias
        y = y.to(out_dtype or x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.type_name}, in_features={self.in_features}, out_features={self.out_features}"

    def dequantized(self, rows: int | None = None) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight these blocks encode (the
        gguf package's de-quantization; for tests and the load-time check), or its first
        ``rows`` rows.

        Raises:
            ValueError: a `packed` layer (its blocks are no longer the file's).
        """
        if self.kernel_type != self.ggml_type:
            raise ValueError("a packed GGUFLinear has no de-quantized view")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        blocks = self.blocks[:rows]
        values = dequantize(blocks.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values)).view(-1, self.in_features)

    @staticmethod
    def concat(parts: list[GGUFLinear]) -> Callable[[torch.Tensor], torch.Tensor]:
        """One product over several layers' output channels, concatenated in order:
        one `packed` `GGUFLinear` over the stacked blocks where all parts share a type,
        else the parts' packed products concatenated (``[..., sum(out_features)]``)."""
        if len({p.ggml_type for p in parts}) == 1 and all(p.bias is None for p in parts):
            blocks = torch.cat([p.blocks for p in parts], dim=0)
            return GGUFLinear(blocks, parts[0].ggml_type, parts[0].in_features).packed().forward
        packed = [p.packed() for p in parts]

        def product(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([p(x) for p in packed], dim=-1)

        return product


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (int64 ``[n_rows]``): row
    ``i`` of the un-permuted weight is row ``order[i]`` of the GGUF tensor (as
    transformers' ``_reverse_permute_weights``)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


class GGUFWeights:
    """A Llama GGUF file's decoder projections and output head as `GGUFLinear` layers.

    Build it with `read`. ``layers[i][role]`` is layer ``i``'s projection (roles:
    `LLAMA_PROJECTIONS` values); ``head`` the output projection (``output.weight``, or
    the tied ``token_embd.weight``) or None where its type has no kernel.
    """

    def __init__(self, layers: list[dict[str, GGUFLinear]], head: GGUFLinear | None) -> None:
        self.layers = layers
        self.head = head

    @classmethod
    def read(cls, path: Path, config: object) -> GGUFWeights:
        """Read ``path``'s blocks for a model of ``config`` (a transformers Llama config).

        Raises:
            ValueError: the file is not a Llama GGUF, its layer count or shapes differ
                from ``config``'s, or a projection's type has no kernel (the message
                says which).
        """
        tensors = _llama_tensors(path)
        n_layers = config.num_hidden_layers
        n_head = config.num_attention_heads
        n_kv = getattr(config, "num_key_value_heads", None) or n_head
        layers: list[dict[str, GGUFLinear]] = []
        for i in range(n_layers):
            layer: dict[str, GGUFLinear] = {}
            for part, role in LLAMA_PROJECTIONS.items():
                name = f"blk.{i}.{part}.weight"
                if name not in tensors:
                    raise ValueError(f"{path.name} has no tensor {name}")
                linear = _linear(tensors[name], path.name)
                if role in ("q", "k"):
                    order = unpermute_rows(linear.out_features, n_head if role == "q" else n_kv)
                    linear.blocks = linear.blocks[order].contiguous()
                layer[role] = linear
            layers.append(layer)
        head_tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
        head = None
        if head_tensor is not None and head_tensor.ggml_type in GGUF_TYPES:
            head = _linear(head_tensor, path.name)
        return cls(layers, head)

    def check_against(self, model: torch.nn.Module) -> None:
        """Compare layer 0's de-quantized blocks with the float weights ``model`` holds
        (transformers' load of the same file): equal after rounding to the model's dtype.

        Raises:
            ValueError: a projection differs (another file, or a row order not undone).
        """
        layer = model.get_decoder().layers[0]
        modules = {
            "q": layer.self_attn.q_proj,
            "k": layer.self_attn.k_proj,
            "v": layer.self_attn.v_proj,
            "o": layer.self_attn.o_proj,
            "gate": layer.mlp.gate_proj,
            "up": layer.mlp.up_proj,
            "down": layer.mlp.down_proj,
        }
        for role, module in modules.items():
            ours = self.layers[0][role].dequantized().to(module.weight.dtype)
            if ours.shape != module.weight.shape or not torch.equal(ours, module.weight.detach()):
                raise ValueError(
                    f"layer 0's {role} projection in the GGUF file differs from the model's "
                    "weight (not the file the model was converted from?)"
                )


def _llama_tensors(path: Path) -> dict[str, _Tensor]:
    """The tensors of a Llama GGUF file by name, their data memory-mapped (the header read
    by `read_gguf_header`, every declared size checked; the tokenizer's metadata skipped).

    Raises:
        ValueError: a header that does not hold, or another architecture.
        OSError: the file cannot be read.
    """
    stat = path.stat()
    try:
        header = _header(str(path), stat.st_size, stat.st_mtime_ns)
    except WeightFileError as exc:
        raise ValueError(str(exc)) from None
    if header.architecture != "llama":
        raise ValueError(f"{path.name}: architecture {header.architecture!r} (gguf serves llama)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return {
        t.name: _Tensor(t, data[header.data_start + t.offset :][: t.nbytes]) for t in header.tensors
    }


@functools.lru_cache(maxsize=4)
def _header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """`read_gguf_header`, once per file version (start-up reads it twice: for
    `gguf_problem`, then for the weights; SmolLM2's vocabulary makes it 0.4 s)."""
    return read_gguf_header(path)


class _Tensor:
    """A tensor of the table with its data (uint8, memory-mapped)."""

    def __init__(self, entry: GGUFTensor, data: np.ndarray) -> None:
        self.name = entry.name
        self.ggml_type = entry.ggml_type
        self.dims = entry.dims
        self.data = data

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` cannot be served from its own blocks (``--quantization auto``): the
    native kernels are not loaded, the file is not a Llama GGUF, or a decoder projection
    has a block type without a kernel; None where it can be. Never raises."""
    reason = kernel_available()
    if reason is not None:
        return reason
    try:
        tensors = _llama_tensors(path)
    except (ValueError, OSError) as exc:
        return str(exc)
    parts = tuple(f".{part}.weight" for part in LLAMA_PROJECTIONS)
    for name, tensor in tensors.items():
        if name.startswith("blk.") and name.endswith(parts) and tensor.ggml_type not in GGUF_TYPES:
            return f"{name} is {tensor.type_name}, which has no kernel"
    return None


def _linear(tensor: _Tensor, file_name: str) -> GGUFLinear:
    if tensor.ggml_type not in GGUF_TYPES:
        names = ", ".join(name for name, _, _ in GGUF_TYPES.values())
        raise ValueError(
            f"{file_name}: {tensor.name} is {tensor.type_name}; --quantization gguf "
            f"multiplies {names}"
        )
    in_features = int(tensor.dims[0])  # GGUF shapes are [K, N]
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
    return GGUFLinear(blocks.view(int(tensor.dims[1]), -1), tensor.ggml_type, in_features)


def read_gguf_weights(
    model: torch.nn.Module, gguf_file: Path | None, device: torch.device
) -> GGUFWeights:
    """The GGUF file's blocks for ``--quantization gguf``, checked against ``model``.

    Raises:
        EngineConfigError: why this model or file cannot be served that way.
    """
    name = describe(model.config)
    if device.type != "cpu":
        raise EngineConfigError(f"{name}: --quantization gguf runs on the CPU only")
    if gguf_file is None:
        raise EngineConfigError(
            f"{name}: --quantization gguf needs a GGUF model (a .gguf file or a model "
            "shipped as one); this one was loaded from a Hugging Face folder"
        )
    reason = kernel_available()
    if reason is not None:
        raise EngineConfigError(f"{name}: --quantization gguf: {reason}")
    try:
        weights = GGUFWeights.read(gguf_file, model.config)
        weights.check_against(model)
    except ValueError as exc:
        raise EngineConfigError(f"{name}: --quantization gguf: {exc}") from exc
    logger.info("--quantization gguf: the decoder multiplies %s's own blocks", gguf_file.name)
    return weights
