"""``--kv-cache-dtype``: the flag, what ``auto`` picks, the cache's dtype and block count,
and attention over a cache whose dtype differs from the model's.

Tolerances: the attention of float32 queries over a bfloat16 cache equals softmax
attention over the keys and values rounded to bfloat16 within float32 rounding
(``1e-5``), and stays within ``2e-2`` of the float32 cache's (bfloat16 keeps 8 bits);
SmolLM2-135M in float32 with a bfloat16 cache gives the float32 cache's greedy tokens
up to a near tie, with logprobs within `LOGPROB_TOLERANCE` nats (measured on an AMD EPYC
with AVX-512-BF16: at most 0.006 for generated tokens and 0.013 for prompt tokens, mean
0.002; 0.037 for prompt tokens with the prefill chunks attended in one call, which reads
even a first chunk's keys back from the cache; float16 keys and values: at most 0.003).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.config import KV_CACHE_DTYPES, CacheConfig, engine_config
from trio_llm.engine.attention import paged_attention, use_native_attention
from trio_llm.engine.attention_metadata import PagedAttentionMetadata
from trio_llm.engine.kv_cache import KVCache, KVGroups, LayerSpec, size_kv_cache
from trio_llm.model_files.dtype_choice import explain_kv_cache_dtype

#: Largest |logprob difference| (nats) between a bfloat16 and a float32 KV cache allowed
#: for SmolLM2's greedy and prompt tokens (measured: up to 0.037; module docstring).
LOGPROB_TOLERANCE = 0.05

AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"avx2", "fma"})


# ------------------------------------------------------------------ the choice


@pytest.mark.parametrize(
    ("flag", "model_dtype", "quantization", "flags", "expected"),
    [
        # A plain float32 model keeps float32 keys (its tokens equal transformers').
        ("auto", "float32", None, AVX512_BF16, "float32"),
        ("auto", "float32", "int8", AVX512_BF16, "float32"),
        ("auto", "bfloat16", None, AVX2_ONLY, "bfloat16"),
        # The GGUF path in float32: bfloat16 where the CPU has AVX-512-BF16 only.
        ("auto", "float32", "gguf", AVX512_BF16, "bfloat16"),
        ("auto", "float32", "gguf", AVX2_ONLY, "float32"),
        ("auto", "bfloat16", "gguf", AVX2_ONLY, "bfloat16"),
        # A dtype given is kept, whatever the model.
        ("float32", "bfloat16", None, AVX512_BF16, "float32"),
        ("float16", "float32", None, AVX2_ONLY, "float16"),
        ("bfloat16", "float32", "gguf", AVX2_ONLY, "bfloat16"),
    ],
)
def test_auto_is_the_models_dtype_except_on_the_gguf_path(
    flag: str, model_dtype: str, quantization: str | None, flags: frozenset[str], expected: str
) -> None:
    dtype, why = explain_kv_cache_dtype(flag, model_dtype, quantization, flags)
    assert dtype == expected
    assert why.startswith(f"--kv-cache-dtype {flag}")


# ------------------------------------------------------------------ the flag


def _serve(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_the_flag_reaches_the_cache_config() -> None:
    assert _serve().engine.cache.kv_cache_dtype == "auto"
    for value in ("auto", "bfloat16", "float16", "float32"):
        assert _serve("--kv-cache-dtype", value).engine.cache.kv_cache_dtype == value
    args = build_parser().parse_args(
        ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--kv-cache-dtype", "bfloat16"]
    )
    assert config_from_args(args).engine.cache.kv_cache_dtype == "bfloat16"
    # The Python API's engine arguments (open_engine, LLM) take it too.
    from trio_llm.async_engine import ENGINE_ARGS, resolve_engine_config

    assert "kv_cache_dtype" in ENGINE_ARGS
    config = resolve_engine_config("m", "inline", 1.0, {"kv_cache_dtype": "float16"})
    assert config.cache.kv_cache_dtype == "float16"


def test_a_bad_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _serve("--kv-cache-dtype", "fp8")
    assert info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="half")
    assert set(KV_CACHE_DTYPES) == {"auto", "bfloat16", "float16", "float32"}


# ------------------------------------------------------------------ the cache


def test_a_16_bit_cache_holds_twice_the_blocks() -> None:
    # 3 layers of 2 KV heads of 8: 48 numbers a token for keys, 48 for values; a block
    # of 4 tokens is 2 * 4 * 48 = 384 numbers: 1,536 bytes in float32, 768 in 16 bits.
    layers = [LayerSpec(num_kv_heads=2, head_dim=8)] * 3
    cache = CacheConfig(block_size=4, kv_cache_memory=1536 * 10)
    counts = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        size = size_kv_cache(layers, cache, max_model_len=16, max_step_tokens=8, dtype=dtype)
        counts[dtype] = size.num_blocks
        kv = KVCache(layers, size.groups, size.num_blocks, size.block_size, dtype)
        assert kv.keys[0].dtype == kv.values[2].dtype == dtype
        assert kv.keys[0].shape == ((size.num_blocks + 1) * 4, 2, 8)
    assert counts == {torch.float32: 10, torch.bfloat16: 20, torch.float16: 20}


def test_the_native_kernel_reads_no_float16_cache() -> None:
    cpu = torch.device("cpu")
    assert use_native_attention("TORCH_SDPA", cpu, torch.float16) is False
    assert use_native_attention("auto", cpu, torch.float16) is False
    with pytest.raises(ValueError, match="CPU_ATTN reads a float32 or bfloat16 KV cache"):
        use_native_attention("CPU_ATTN", cpu, torch.float16)


# ------------------------------------------------------------------ attention


def _decode(lengths: list[int], kv_dtype: torch.dtype, exact_single: bool):
    """One layer's decode of ``len(lengths)`` requests, float32 queries over a cache of
    ``kv_dtype`` holding random keys and values (the same numbers for every dtype), on
    the pure-torch path. Returns the output ``[N, H, D]``, the cache and the block
    tables, the query and the scale."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    columns = [-(-length // block_size) for length in lengths]
    num_blocks = sum(columns) + 1
    spec = LayerSpec(num_kv_heads=num_kv_heads, head_dim=head_dim)
    cache = KVCache([spec], KVGroups(((0,),), (None,)), num_blocks, block_size, kv_dtype)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    tables = torch.zeros(len(lengths), max(columns), dtype=torch.long)
    next_block = 1
    for n, count in enumerate(columns):
        tables[n, :count] = torch.arange(next_block, next_block + count)
        next_block += count
    lens = torch.tensor(lengths)
    pos = lens - 1
    slots = tables[torch.arange(len(lengths)), pos // block_size] * block_size + pos % block_size
    paged = PagedAttentionMetadata(
        kv_cache=cache,
        slot_mapping=[slots],
        num_decode=len(lengths),
        decode_blocks=[tables],
        decode_lengths=lens,
        prefills=[],
        workspace={},
        dtype=torch.float32,
        decode_context_lens=lengths if exact_single else [],
    )
    n = len(lengths)
    query = torch.randn(1, num_heads, n, head_dim, generator=gen)
    key = torch.randn(1, num_kv_heads, n, head_dim, generator=gen)
    value = torch.randn(1, num_kv_heads, n, head_dim, generator=gen)
    scale = head_dim**-0.5
    out, _ = paged_attention(
        SimpleNamespace(layer_idx=0), query, key, value, None, scaling=scale, paged=paged
    )
    return out[0], cache, tables, query, scale


def _by_hand(cache: KVCache, tables, lengths, query, scale) -> torch.Tensor:
    """Softmax attention in float64 over each request's keys and values as the cache
    holds them (its new key included), grouped-query heads sharing KV heads."""
    block_size = cache.block_size
    rows = []
    for n, length in enumerate(lengths):
        pos = torch.arange(length)
        slots = tables[n, pos // block_size] * block_size + pos % block_size
        keys = cache.keys[0][slots].double()  # [L, H_kv, D]
        values = cache.values[0][slots].double()
        q = query[0, :, n].double()  # [H, D]
        group = q.shape[0] // keys.shape[1]
        heads = []
        for h in range(q.shape[0]):
            weights = torch.softmax(keys[:, h // group] @ q[h] * scale, dim=0)
            heads.append(weights @ values[:, h // group])
        rows.append(torch.stack(heads))
    return torch.stack(rows).float()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lengths", "exact_single"), [([7], True), ([5, 9, 13], False), ([6], False)]
)
def test_reference_decode_over_a_16_bit_cache(
    kv_dtype: torch.dtype, lengths: list[int], exact_single: bool
) -> None:
    """The new keys are written rounded to the cache's dtype, and the float32 queries
    attend over what the cache holds, in float32: by hand within 1e-5, and within 2e-2
    of a float32 cache of the same numbers."""
    out, cache, tables, query, scale = _decode(lengths, kv_dtype, exact_single)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, _by_hand(cache, tables, lengths, query, scale), rtol=1e-5, atol=1e-5
    )
    exact, *_ = _decode(lengths, torch.float32, exact_single)
    torch.testing.assert_close(out, exact, rtol=0, atol=2e-2)


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M loaded in float32 for the paged attention, with its folder."""
    from trio_llm.config import DEFAULT_MODEL, default_cache_dir
    from trio_llm.engine.attention import ATTENTION_NAME
    from trio_llm.model_files.loader import load_model, resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL, default_cache_dir())
    return load_model(model_dir, "float32", ATTENTION_NAME), model_dir


PROMPTS = {
    # Longer than the 16-token step budget: the second prefill chunk reads the first
    # chunk's keys back from the cache.
    "long": list(range(1000, 1029)),
    "short": [504, 3458, 282, 4649, 314, 7042, 30, 378],
}
MAX_TOKENS = {"long": 12, "short": 5}


def _run(model, model_dir, *, gpu_paths: bool = False, **engine_args):
    """The two prompts decoding together (then the long one alone) on an in-process
    engine; returns the core and, per request, (tokens, logprobs, prompt logprobs).
    ``gpu_paths``: the paths a GPU takes, on the CPU: the prefill chunks attended in one
    call, and the decode steps padded into the static buffers of the CUDA graphs
    (`DecodeGraphs` without capturing)."""
    from trio_llm.config import DEFAULT_MODEL
    from trio_llm.engine.core import EngineCore
    from trio_llm.engine.cuda_graphs import DecodeGraphs
    from trio_llm.messages import AddRequest, SamplingParams

    config = engine_config(
        DEFAULT_MODEL,
        max_model_len=256,
        kv_cache_memory=64 * 1024**2,
        max_num_batched_tokens=16,
        num_threads=1,
        **engine_args,
    )
    core = EngineCore(model, config, str(model_dir))
    if gpu_paths:
        core.runner.batched_prefill = True
        core.runner.graphs = DecodeGraphs(core.runner, max_num_seqs=8, capture=False)
    for name, prompt in PROMPTS.items():
        params = SamplingParams(
            max_tokens=MAX_TOKENS[name],
            temperature=0.0,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0,
        )
        assert core.add_request(AddRequest(name, prompt, params)) is None
    out: dict[str, tuple[list[int], list[float], list[float]]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            tokens, logprobs, prompt = out.setdefault(output.request_id, ([], [], []))
            tokens += output.new_token_ids
            logprobs += [entry.logprob for entry in output.logprobs or []]
            prompt += [entry.logprob for entry in output.prompt_logprobs or []]
    core.close()
    return core, out


@pytest.fixture(scope="module")
def float32_kv(smollm2):
    """The float32 model with ``--kv-cache-dtype auto``: its core and outputs."""
    return _run(*smollm2)


@pytest.mark.slow
def test_auto_keeps_float32_for_a_float32_model(float32_kv) -> None:
    core, out = float32_kv
    assert core.kv_cache.keys[0].dtype == torch.float32
    assert core.kv_cache_dtype == torch.float32
    assert {name: len(tokens) for name, (tokens, _, _) in out.items()} == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kv_dtype", "backend", "gpu_paths"),
    [
        ("bfloat16", "auto", False),  # the native kernel where it loaded
        ("bfloat16", "TORCH_SDPA", False),  # reference: gathered and single decodes
        # A GPU's: prefill chunks in one call, decodes in the CUDA graphs' buffers.
        ("bfloat16", "TORCH_SDPA", True),
        ("float16", "auto", False),  # always the reference path
    ],
)
def test_a_16_bit_cache_stays_near_the_float32_one(
    smollm2, float32_kv, kv_dtype: str, backend: str, gpu_paths: bool
) -> None:
    exact_core, exact = float32_kv
    core, out = _run(
        *smollm2,
        kv_cache_dtype=kv_dtype,
        attention_backend=backend,
        gpu_paths=gpu_paths,
    )
    assert core.kv_cache.keys[0].dtype == getattr(torch, kv_dtype)
    if kv_dtype == "float16":
        assert core.runner.native_attention is False
    if gpu_paths:
        assert core.runner.graphs is not None and core.runner.graphs.num_runs > 0
    # The same 64 MiB hold twice the blocks.
    assert core.info.num_kv_blocks in (
        2 * exact_core.info.num_kv_blocks,
        2 * exact_core.info.num_kv_blocks + 1,
    )
    for name in PROMPTS:
        tokens, logprobs, prompt = out[name]
        exact_tokens, exact_logprobs, exact_prompt = exact[name]
        _same_greedy_up_to_a_near_tie(tokens, logprobs, exact_tokens, exact_logprobs)
        assert len(prompt) == len(PROMPTS[name]) - 1
        torch.testing.assert_close(
            torch.tensor(prompt), torch.tensor(exact_prompt), rtol=0, atol=LOGPROB_TOLERANCE
        )


def _same_greedy_up_to_a_near_tie(
    tokens: list[int], logprobs: list[float], exact_tokens: list[int], exact_logprobs: list[float]
) -> None:
    """Greedy tokens equal, each logprob within `LOGPROB_TOLERANCE`, up to the first token
    that differs, if any: there the float32 cache's top token and the 16-bit one's must
    be a near tie (if every logprob moves by at most the tolerance, the two top
    logprobs are within it). After it the contexts differ: nothing more is compared.
    (Measured: with the prefill chunks in one call, a bfloat16 cache turns SmolLM2's
    third token of "short" from 4649 at -1.371 to 260 at -1.368.)"""
    assert len(tokens) == len(exact_tokens)
    for i, (token, exact_token) in enumerate(zip(tokens, exact_tokens, strict=True)):
        assert abs(logprobs[i] - exact_logprobs[i]) <= LOGPROB_TOLERANCE, (i, tokens, exact_tokens)
        if token != exact_token:
            print(
                f"near tie at token {i}: {token} ({logprobs[i]:.3f}) for {exact_token} "
                f"({exact_logprobs[i]:.3f})"
            )
            return


@pytest.mark.slow
def test_cpu_attn_refuses_a_float16_cache(smollm2) -> None:
    from trio_llm.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="CPU_ATTN reads a float32 or bfloat16 KV cache"):
        _run(*smollm2, kv_cache_dtype="float16", attention_backend="CPU_ATTN")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cpu", "expected"), [(AVX512_BF16, torch.bfloat16), (AVX2_ONLY, torch.float32)]
)
def test_auto_on_the_gguf_path_follows_the_cpu(
    monkeypatch: pytest.MonkeyPatch, cpu: frozenset[str], expected: torch.dtype
) -> None:
    """``--quantization gguf --dtype float32``: bfloat16 keys and values (twice the
    blocks of the default 2 GiB) where the CPU has AVX-512-BF16, else float32."""
    from trio_llm.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MODEL
    from trio_llm.engine.core import EngineCore
    from trio_llm.engine.kernels import load
    from trio_llm.model_files import dtype_choice

    if not load().loaded:
        pytest.skip("--quantization gguf needs the native kernels")
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: cpu)
    core = EngineCore.from_config(
        engine_config(DEFAULT_MODEL, dtype="float32", quantization="gguf", max_model_len=512)
    )
    core.close()
    assert core.kv_cache.keys[0].dtype == expected
    # SmolLM2-135M: 30 layers of 3 KV heads of 64; keys and values of 16 tokens a block.
    per_block = 2 * 16 * 30 * 3 * 64 * (2 if expected == torch.bfloat16 else 4)
    assert core.info.num_kv_blocks == DEFAULT_KV_CACHE_MEMORY // per_block
    print(
        f"--quantization gguf, --kv-cache-dtype auto: {expected}, {core.info.num_kv_blocks} blocks"
    )
