"""The fused decode-layer pieces (``csrc/layer_ops.cpp``) against the torch operators they
replace, and the native forward pass that uses them for quantized weights.

Skipped where the kernels do not load (no compiler).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import rotate_half

from trio_llm.engine import kernels

STATUS = kernels.load()
pytestmark = pytest.mark.skipif(
    not STATUS.loaded, reason=f"native kernels not loaded: {STATUS.detail}"
)
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: equal up to float32 rounding; bfloat16: up to one rounding of the result."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 7, 576), (3, 70)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_then_rms_norm(
    dtype: torch.dtype, shape: tuple[int, ...], with_delta: bool
) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    hidden = torch.randn(shape, generator=gen).to(dtype)
    delta = torch.randn(shape, generator=gen).to(dtype) if with_delta else None
    weight = torch.rand(shape[-1], generator=gen).to(dtype)
    summed = hidden + delta if delta is not None else hidden.clone()
    expected = F.rms_norm(summed.float(), (shape[-1],), weight.float(), 1e-5).to(dtype)

    updated = hidden.clone()
    normed = torch.ops.trio_llm.add_rms_norm_(updated, delta, weight, 1e-5)

    assert torch.equal(updated, summed), "hidden must hold hidden + delta afterwards"
    assert normed.shape == shape and normed.dtype == dtype
    _close(normed, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotary_rotates_q_and_k_heads_and_leaves_v(dtype: torch.dtype, tokens: int) -> None:
    """SmolLM2's layout: 9 query and 3 key heads rotated, 3 value heads untouched."""
    d, rotated, width = 64, 12, 15 * 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(1, tokens, width, generator=gen).to(dtype)
    angles = torch.rand(tokens, d // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).unsqueeze(0)  # [1, T, D]
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).unsqueeze(0)
    heads = qkv[..., : rotated * d].view(1, tokens, rotated, d).float()
    c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    expected = (heads * c + rotate_half(heads) * s).to(dtype)

    out = qkv.clone()
    torch.ops.trio_llm.rotary_(out, cos, sin, rotated, d)

    _close(out[..., : rotated * d].view(1, tokens, rotated, d), expected, dtype)
    assert torch.equal(out[..., rotated * d :], qkv[..., rotated * d :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 3072), (1, 4, 3072), (2, 18)])
def test_silu_and_mul_is_the_gated_activation(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(shape, generator=gen) * 4).to(dtype)
    inner = shape[-1] // 2
    expected = (F.silu(gate_up[..., :inner].float()) * gate_up[..., inner:].float()).to(dtype)

    out = torch.ops.trio_llm.silu_and_mul(gate_up)

    assert out.shape == (*shape[:-1], inner)
    _close(out, expected, dtype)


def test_the_pieces_refuse_what_they_cannot_compute() -> None:
    ops = torch.ops.trio_llm
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(torch.randn(4, 6).t())
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm_(torch.randn(2, 8), None, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="delta must have"):
        ops.add_rms_norm_(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.rotary_(torch.randn(1, 2, 64), torch.ones(1, 2, 32), torch.ones(1, 2, 32), 3, 32)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        ops.rotary_(torch.randn(1, 2, 64), torch.ones(1, 1, 32), torch.ones(1, 1, 32), 2, 32)


def _greedy_logprobs(core, prompt: list[int]) -> tuple[list[int], list[float]]:
    from tests.support.engine_runs import run_request
    from trio_llm.messages import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = run_request(core, prompt, params)
    tokens = [token for output in outputs for token in output.new_token_ids]
    return tokens, [e.logprob for output in outputs for e in output.logprobs or []]


@pytest.mark.slow
def test_fused_forward_is_the_unfused_one(smol_tokenizer) -> None:
    """SmolLM2: the fused pieces are on for quantized weights only; on float32 weights
    (turned on by hand, where nothing else rounds) they give the unfused pass's greedy
    tokens and logprobs within float32 rounding."""
    from trio_llm.config import DEFAULT_MODEL, engine_config
    from trio_llm.engine.core import EngineCore

    prompt = smol_tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    core = EngineCore.from_config(engine_config(DEFAULT_MODEL, dtype="float32"))
    native = core.runner.native
    assert native is not None and native.fused is False
    unfused = _greedy_logprobs(core, prompt)
    native.fused = True
    fused = _greedy_logprobs(core, prompt)
    core.close()
    assert fused[0] == unfused[0]
    torch.testing.assert_close(torch.tensor(fused[1]), torch.tensor(unfused[1]), atol=1e-4, rtol=0)

    quantized = EngineCore.from_config(
        engine_config(DEFAULT_MODEL, dtype="float32", quantization="int8")
    )
    assert quantized.runner.native is not None and quantized.runner.native.fused is True
    quantized.close()
