"""One call per decoder layer at decode (issue 42, item 3): on the GGUF path a decode-only
step runs each layer as ``torch.ops.trio_llm.decoder_layer_decode``, the operators of
`NativeLlama._fused_call`'s loop behind one dispatch. The same engine with that call
turned off (the operator-by-operator loop) is the reference: both run the same kernels in
the same order, so greedy tokens and logprobs must be equal (each engine built fresh: a
prefix-cache hit reads keys back from the bfloat16 cache where a fresh prefill attends its
float32 ones, which may flip a near tie)."""

from __future__ import annotations

import pytest

from trio_llm.config import engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.engine.gguf_linear import kernel_available
from trio_llm.messages import AddRequest, SamplingParams

PROMPTS = [list(range(1000, 1286)), list(range(2000, 2040)), [17, 29, 301, 4000] * 30]


def _run(one_call: bool) -> tuple[dict[str, list[int]], dict[str, list[float]], int]:
    """Tokens and logprobs per request of three decoding together, and how many layer
    calls went through the one-call path."""
    core = EngineCore.from_config(engine_config())
    native = core.runner.native
    assert native is not None and native.one_call, "the GGUF default has the one-call path"
    native.one_call = one_call
    calls = 0
    run_layer = native._one_call

    def counted(*args):
        nonlocal calls
        calls += 1
        return run_layer(*args)

    native._one_call = counted
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(AddRequest(str(i), prompt, params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            for entry in output.logprobs or []:
                logprobs.setdefault(output.request_id, []).extend(entry.top_logprobs)
    return tokens, logprobs, calls


@pytest.mark.slow
@pytest.mark.skipif(kernel_available() is not None, reason=f"native kernels: {kernel_available()}")
def test_one_call_per_layer_equals_the_operator_loop() -> None:
    tokens, logprobs, calls = _run(True)
    reference, reference_logprobs, reference_calls = _run(False)
    assert reference_calls == 0
    # 30 layers for each of the decode-only steps (the first steps prefill).
    assert calls >= 30 * 20 and calls % 30 == 0
    assert tokens == reference
    assert logprobs == reference_logprobs
