"""GGUF-native weights (``--quantization gguf``): the ``gguf_matmul`` kernel and `GGUFLinear`.

The reference is the gguf package's own de-quantization (``gguf.quants.dequantize``)
followed by a float64 matmul:

- tight: against the same reference with the activations quantized as the kernel does
  (int8 per 32-value block, scale amax / 127, rounding half to even): only float32
  summation order separates them (bound: 1e-5 of the output's largest magnitude);
- loose: against the float product of the unquantized activations, within the error
  the int8 rounding can cause: ``sum_k |W[n, k]| * d[m, k // 32] / 2`` per output.

Then a real SmolLM2 tensor (Q4_1, q rows un-permuted) against the float weight
transformers loaded from the same file, and the engine end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from trio_llm.engine.gguf_linear import (
    GGUF_TYPES,
    GGUFLinear,
    GGUFWeights,
    kernel_available,
    unpermute_rows,
)

REASON = kernel_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels: {REASON}")

T = GGMLQuantizationType
FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]


def _fp16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), np.uint8)


def _random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[n, row_bytes]``: the gguf package's quantization of random weights where
    it has one (Q4_0, Q4_1, Q8_0), else random bytes (every bit pattern of the K-quants'
    scales and values) with fixed fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    if qtype == T.Q4_K:
        raw[..., 0:2] = _fp16_bytes(0.01)  # d
        raw[..., 2:4] = _fp16_bytes(0.02)  # dmin
    else:
        raw[..., 208:210] = _fp16_bytes(0.002)  # d
    return raw.reshape(n, -1)


def _quantized_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's int8 quantization per 32-value block, as the kernel's: (q, scale)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)
    q = np.round(blocks * inverse[..., None]).astype(np.int8)
    return q.reshape(m, k), scale.astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_numpy_s(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.tensor([0.01, 1.0, 40.0]).repeat(32)
    x[2, 32:64] = 0  # an all-zero block: scale 0, values 0
    q, d, ds = torch.ops.trio_llm.gguf_quantize_rows(x.to(dtype))
    want_q, want_d = _quantized_activations(x.to(dtype).float().numpy())
    np.testing.assert_array_equal(q.numpy(), want_q)
    np.testing.assert_array_equal(d.numpy(), want_d)
    sums = want_q.reshape(5, 3, 32).astype(np.int64).sum(-1)
    np.testing.assert_allclose(ds.numpy(), want_d * sums, rtol=1e-6)
    assert d[2, 1] == 0 and (q[2, 32:64] == 0).all()


@pytest.mark.parametrize("m", [1, 7, 32, 70])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_kernel_is_the_dequantized_product(qtype: GGMLQuantizationType, m: int) -> None:
    k = 512  # a multiple of 32 and of 256
    n = 37  # not a multiple of the kernel's tiles
    raw = _random_blocks(qtype, n, k, seed=m)
    weight = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = np.random.default_rng(100 + m).standard_normal((m, k)).astype(np.float32)
    y = torch.ops.trio_llm.gguf_matmul_int8(torch.from_numpy(x), torch.from_numpy(raw), int(qtype))
    assert y.dtype == torch.float32 and y.shape == (m, n)
    y = y.numpy().astype(np.float64)
    q, scale = _quantized_activations(x)
    x_seen = (q.reshape(m, -1, 32) * scale[..., None].astype(np.float64)).reshape(m, k)
    tight = x_seen @ weight.T
    assert np.abs(y - tight).max() <= 1e-5 * np.abs(tight).max()
    exact = x.astype(np.float64) @ weight.T
    rounding = (np.abs(weight)[None] * np.repeat(scale, 32, axis=1)[:, None, :] / 2).sum(-1)
    assert (np.abs(y - exact) <= rounding + 1e-5 * np.abs(exact).max()).all()


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float64 of ``values`` rounded to bfloat16 (nearest, ties to even), as torch does."""
    return torch.from_numpy(values.astype(np.float32)).bfloat16().double().numpy()


@pytest.mark.skipif(
    REASON is not None or not torch.ops.trio_llm.gguf_tiles_available(),
    reason="no AMX-BF16 tiles on this CPU (or the kernel refused the tile state)",
)
@pytest.mark.parametrize("m", [4, 17, 32, 70])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_are_the_bfloat16_rounded_product(
    qtype: GGMLQuantizationType, m: int, dtype: torch.dtype
) -> None:
    """From 4 rows on, where the CPU has AMX, gguf_matmul multiplies on tiles: the weights
    de-quantized and the activations both rounded to bfloat16, float32 sums."""
    k, n = 512, 96  # n a multiple of the 32 output channels of a task
    raw = _random_blocks(qtype, n, k, seed=m)
    weight = dequantize(raw, qtype).reshape(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = torch.ops.trio_llm.gguf_matmul(x, torch.from_numpy(raw), int(qtype))
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = _bfloat16(x.float().numpy()) @ _bfloat16(weight).T
    assert np.abs(y.numpy() - want).max() <= 1e-5 * np.abs(want).max()
    # and the int8 row kernel, the path below 4 rows, stays within its own bound of it
    int8 = torch.ops.trio_llm.gguf_matmul_int8(x, torch.from_numpy(raw), int(qtype)).numpy()
    assert np.abs(int8 - want).max() <= 0.05 * np.abs(want).max()


PACKS = REASON is None and torch.ops.trio_llm.gguf_packed_type(int(T.Q4_1)) >= 0


@pytest.mark.skipif(not PACKS, reason="no AVX-512 VNNI: blocks are not repacked on this CPU")
@pytest.mark.parametrize("m", [1, 3, 6, 15, 16, 33, 40])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_packed_blocks_give_the_same_products(qtype: GGMLQuantizationType, m: int) -> None:
    """Blocks repacked 16 rows at a time (`GGUFLinear.packed`): below 16 rows the VNNI
    kernel takes the same integer dot products as the row kernel (only float32 summation
    order differs); from 16 rows where the CPU has AMX tiles, and from 32 where it has
    AVX512_BF16 dot products, the bfloat16 product (weights and activations rounded to
    bfloat16, float32 sums)."""
    k, n = 256, 48
    raw = torch.from_numpy(_random_blocks(qtype, n, k, seed=m))
    layer = GGUFLinear(raw, int(qtype), k)
    packed = layer.packed()
    assert packed.kernel_type != int(qtype) and packed.out_features == n
    with pytest.raises(ValueError, match="packed"):
        packed.dequantized()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    row = torch.ops.trio_llm.gguf_matmul_int8(x, raw, int(qtype))
    scale = row.abs().max()
    ops = torch.ops.trio_llm
    vnni = ops.gguf_matmul_int8(x, packed.blocks, packed.kernel_type)
    assert (vnni - row).abs().max() <= 1e-5 * scale
    y = packed(x)
    tiles, bf16_dots = ops.gguf_tiles_available(), "avx512_bf16" in ops.isa().split()
    if (m >= 16 and tiles) or (m >= 32 and bf16_dots):
        weight = dequantize(raw.numpy(), qtype).reshape(n, k)
        want = _bfloat16(x.numpy()) @ _bfloat16(weight).T
        assert np.abs(y.numpy() - want).max() <= 1e-5 * np.abs(want).max()
    else:
        assert (y - row).abs().max() <= 1e-5 * scale


def test_types_without_a_packing_stay_as_they_are() -> None:
    raw = torch.from_numpy(_random_blocks(T.Q6_K, 16, 256, seed=0))
    layer = GGUFLinear(raw, int(T.Q6_K), 256)
    assert layer.packed() is layer
    odd = GGUFLinear(torch.from_numpy(_random_blocks(T.Q4_1, 5, 32, seed=0)), int(T.Q4_1), 32)
    assert odd.packed() is odd  # 5 output channels: not a multiple of 16


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_kernel_with_one_block_per_row_and_bfloat16_input(qtype: GGMLQuantizationType) -> None:
    raw = _random_blocks(qtype, 5, 32, seed=1)
    x = torch.randn(3, 32).to(torch.bfloat16)
    layer = GGUFLinear(torch.from_numpy(raw), int(qtype), 32)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    reference = layer(x.float())
    torch.testing.assert_close(y, reference.to(torch.bfloat16))


def test_kernel_refuses_mismatched_blocks() -> None:
    raw = torch.zeros(4, 20, dtype=torch.uint8)  # one Q4_1 block per row: K = 32
    with pytest.raises(RuntimeError, match="needs 40"):
        torch.ops.trio_llm.gguf_matmul(torch.zeros(1, 64), raw, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        torch.ops.trio_llm.gguf_matmul(torch.zeros(1, 32), raw, int(T.Q5_0))
    with pytest.raises(ValueError, match="no kernel"):
        GGUFLinear(raw, int(T.Q5_0), 32)
    with pytest.raises(ValueError, match=r"uint8 \[N, 40\]"):
        GGUFLinear(raw, int(T.Q4_1), 64)


def test_unpermute_rows_is_transformers_reverse_permutation() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    for heads in (1, 3):
        want = LlamaTensorProcessor._reverse_permute_weights(None, weights, heads, heads)
        got = weights[unpermute_rows(24, heads).numpy()]
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the real SmolLM2 file


@pytest.fixture(scope="module")
def smollm2_tensors(real_model_dir):
    """(GGUF tensors by name, the converted folder's float weights by name, config)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from trio_llm.model_files.named_models import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    floats = {}
    with safe_open(str(real_model_dir / "model.safetensors"), "pt") as weights:
        for name in ("q_proj", "k_proj", "v_proj"):
            floats[name] = weights.get_tensor(f"model.layers.3.self_attn.{name}.weight")
        floats["down_proj"] = weights.get_tensor("model.layers.3.mlp.down_proj.weight")
    return {t.name: t for t in reader.tensors}, floats, AutoConfig.from_pretrained(real_model_dir)


def _gguf_linear(tensor, heads: int | None = None) -> GGUFLinear:
    blocks = torch.from_numpy(np.array(tensor.data)).view(int(tensor.shape[1]), -1)
    if heads is not None:
        blocks = blocks[unpermute_rows(blocks.shape[0], heads)].contiguous()
    return GGUFLinear(blocks, int(tensor.tensor_type), int(tensor.shape[0]))


@pytest.mark.parametrize(
    ("gguf_name", "name"),
    [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("ffn_down", "down_proj")],
)
def test_real_tensor_is_the_loaded_float_weight(smollm2_tensors, gguf_name, name) -> None:
    tensors, floats, config = smollm2_tensors
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensor = tensors[f"blk.3.{gguf_name}.weight"]
    assert int(tensor.tensor_type) in GGUF_TYPES
    layer = _gguf_linear(tensor, heads.get(gguf_name))
    weight = floats[name].float()
    # The blocks (q / k rows un-permuted) are exactly what transformers de-quantized...
    assert torch.equal(layer.dequantized(), weight)
    # ...and the product is the float product up to the activations' int8 rounding.
    torch.manual_seed(0)
    x = torch.randn(4, layer.in_features)
    y, exact = layer(x), x @ weight.T
    _, scale = _quantized_activations(x.numpy())
    rounding = (weight.abs()[None] * torch.from_numpy(np.repeat(scale, 32, 1))[:, None] / 2).sum(-1)
    assert ((y - exact).abs() <= rounding + 1e-4).all()


def _write_gguf(path, architecture: str) -> None:
    """A GGUF file of ``architecture`` whose one tensor, blk.0.attn_q, is F32."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_refuse_what_they_cannot_serve(tmp_path, smollm2_tensors) -> None:
    """A Llama file whose projection is F32 (no kernel) is refused with its name, and a
    file of another architecture (its rows' order and names differ) by its architecture."""
    _, _, config = smollm2_tensors
    _write_gguf(tmp_path / "f32.gguf", "llama")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight is F32"):
        GGUFWeights.read(tmp_path / "f32.gguf", config)
    _write_gguf(tmp_path / "gemma3.gguf", "gemma3")
    with pytest.raises(ValueError, match="architecture 'gemma3'"):
        GGUFWeights.read(tmp_path / "gemma3.gguf", config)


# ---------------------------------------------------------------- the engine


def _greedy(quantization: str | None, prompt: list[int], max_tokens: int):
    from tests.support.engine_runs import run_request
    from trio_llm.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig
    from trio_llm.engine.core import EngineCore
    from trio_llm.messages import SamplingParams

    config = EngineConfig(
        model=ModelConfig(
            model=DEFAULT_MODEL, dtype="float32", quantization=quantization, max_model_len=512
        ),
        cache=CacheConfig(num_kv_blocks=64),
    )
    core = EngineCore.from_config(config)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0
    )
    outputs = run_request(core, prompt, params)
    tokens = [token for output in outputs for token in output.new_token_ids]
    logprobs = [e.logprob for output in outputs for e in output.prompt_logprobs or []]
    return tokens, torch.tensor(logprobs), core


@pytest.mark.slow
def test_engine_serves_the_gguf_blocks(smol_tokenizer) -> None:
    """SmolLM2 with --quantization gguf: its decoder and head multiply the file's blocks;
    prompt logprobs stay near the float32 model's and greedy tokens are reported.

    Measured (AMD EPYC, AVX2): the first generated token is a near tie in the float32
    model ("The" 504 vs "L" 60) that the int8 activations flip, so greedy outputs of a
    chat prompt differ from the first token; on this plain-text prompt all 16 agree
    (printed). llama-cpp-python 0.3.36 on the same file gave the same 16 tokens as
    ``-q gguf`` on both prompts (docs/benchmarks.md, "Native kernels (issue 32)").
    """
    torch.set_num_threads(1)
    prompt = smol_tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    exact_tokens, exact, _ = _greedy(None, prompt, 16)
    tokens, approx, core = _greedy("gguf", prompt, 16)
    native = core.runner.native
    assert native is not None
    assert native.layers[0].o.__self__.type_name == "Q4_1"
    assert core.runner.quantized_head is not None
    assert core.runner.quantized_head.func.__self__.type_name == "Q8_0"
    agree = next(
        (i for i, (a, b) in enumerate(zip(tokens, exact_tokens, strict=True)) if a != b), 16
    )
    print(f"gguf greedy: {agree} of 16 leading tokens equal float32's: {tokens} {exact_tokens}")
    # Prompt logprobs (the model's own next-token log-probabilities over the prompt):
    # within 0.15 nats on average of float32's (the int8 activations' rounding).
    assert approx.shape == exact.shape
    print(f"prompt logprobs: mean |gguf - float32| {(approx - exact).abs().mean():.4f} nats")
    assert (approx - exact).abs().mean() < 0.15
    assert tokens[0] == exact_tokens[0]


@pytest.mark.slow
def test_engine_refuses_gguf_for_a_folder_model() -> None:
    import copy

    from transformers import LlamaForCausalLM

    from tests.support.tiny_model import tiny_llama_config
    from trio_llm.config import CacheConfig, EngineConfig, ModelConfig
    from trio_llm.engine.attention import ATTENTION_NAME
    from trio_llm.engine.core import EngineCore
    from trio_llm.errors import EngineConfigError

    config = tiny_llama_config(vocab_size=512, max_position_embeddings=256)
    config._attn_implementation = ATTENTION_NAME
    model = LlamaForCausalLM(config).eval()
    engine_config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128, quantization="gguf"),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
    )
    with pytest.raises(EngineConfigError, match="needs a GGUF model"):
        EngineCore(copy.deepcopy(model), engine_config, "tiny")
