"""Quantized by default (issue 42, item 1): a GGUF model given no ``--quantization`` is
served from its own blocks, and that path stays close to the same file de-quantized to
float32 under teacher forcing.

The reference is the float32 engine (``--dtype float32``: de-quantized weights, greedy
tokens identical to transformers'). It continues 8 mixed prompts greedily for 128 tokens;
the default engine then reads those sequences (never its own tokens) and its most likely
token at each of the 1,024 continuation positions is compared with the reference's. The
issue's bar is 98 %; bench/gguf_agreement.py prints the same figures beside llama.cpp's
(99.7 % in prefill, 98.3 % one token a step, llama.cpp 98.3 %, on an Intel Xeon with AMX;
99.4 % in prefill on an AMD EPYC with AVX512_BF16, whose prefill products are bfloat16 too).
"""

from __future__ import annotations

import pytest

from tests.support.engine_runs import run_request
from trio_llm.config import engine_config
from trio_llm.engine.core import EngineCore
from trio_llm.engine.gguf_linear import kernel_available
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.model_files.dtype_choice import explain_quantization

CHATS = [
    "Describe a walk through a forest in autumn.",
    "How does a compiler turn source code into machine code?",
    "Give three tips for learning a new language.",
    "Write a haiku about the sea, then explain it.",
]
TEXTS = [
    "In 1969 the first humans landed on the Moon. The mission",
    "import os\n\ndef list_files(folder):\n",
    "The recipe calls for two cups of flour, one egg and",
    "Chapter 1\n\nIt was raining when the train finally arrived at",
]


def test_auto_picks_the_blocks_only_for_a_gguf_file_it_can_serve(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    fine = lambda path: None  # noqa: E731
    assert explain_quantization(None, "auto", "cpu", gguf, fine)[0] == "gguf"
    assert explain_quantization(None, "bfloat16", "cpu", gguf, fine)[0] == "gguf"
    for dtype, device, path in (("float32", "cpu", gguf), ("auto", "cuda", gguf)):
        assert explain_quantization(None, dtype, device, path, fine)[0] is None
    assert explain_quantization(None, "auto", "cpu", None, fine)[0] is None
    method, why = explain_quantization(None, "auto", "cpu", gguf, lambda path: "no kernels")
    assert method is None and "no kernels" in why
    assert explain_quantization("none", "auto", "cpu", gguf, fine)[0] is None
    assert explain_quantization("int8", "auto", "cpu", None, fine)[0] == "int8"


def _positions(core: EngineCore, sequences: list[list[int]], starts: list[int]) -> list:
    """(top-1 token, logprob of the sequence's token) at each continuation position."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    out = []
    for sequence, start in zip(sequences, starts, strict=True):
        entries = [e for o in run_request(core, sequence, params) for e in o.prompt_logprobs]
        out += [(e.top_token_ids[0], e.logprob) for e in entries[start - 1 :]]
    return out


@pytest.mark.slow
@pytest.mark.skipif(kernel_available() is not None, reason=f"native kernels: {kernel_available()}")
def test_the_default_gguf_path_agrees_with_float32_under_teacher_forcing(smol_tokenizer) -> None:
    reference_core = EngineCore.from_config(engine_config(dtype="float32"))
    assert reference_core.config.model.quantization == "none"
    chats = [smol_tokenizer.render_chat([{"role": "user", "content": c}]) for c in CHATS]
    starts = [smol_tokenizer.encode(t, add_special_tokens=False) for t in chats + TEXTS]
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, start in enumerate(starts):
        reference_core.add_request(AddRequest(str(i), start, greedy))
    continuations: dict[str, list[int]] = {str(i): [] for i in range(len(starts))}
    while reference_core.has_unfinished_requests():
        for output in reference_core.step().outputs:
            continuations[output.request_id] += output.new_token_ids
    sequences = [s + continuations[str(i)] for i, s in enumerate(starts)]
    lengths = [len(s) for s in starts]
    reference = _positions(reference_core, sequences, lengths)
    reference_core.close()
    assert len(reference) == 1024
    # the reference reads its own greedy tokens back as its top-1
    assert all(top == seq[p] for (top, _), seq, p in _flat(sequences, lengths, reference))

    core = EngineCore.from_config(engine_config())  # no quantization, no dtype given
    assert core.config.model.quantization == "gguf"
    assert core.runner.native is not None and core.runner.quantized_head is not None
    ours = _positions(core, sequences, lengths)
    core.close()
    same = sum(a[0] == b[0] for a, b in zip(reference, ours, strict=True))
    diff = sum(abs(a[1] - b[1]) for a, b in zip(reference, ours, strict=True)) / len(ours)
    print(f"gguf default: top-1 {same}/{len(ours)}, mean |dlogprob| {diff:.4f} nats")
    assert same >= 0.98 * len(ours)


def _flat(sequences, lengths, positions):
    """(position's entry, its sequence, the index of the token it predicts), in order."""
    index = 0
    for sequence, start in zip(sequences, lengths, strict=True):
        for p in range(start, len(sequence)):
            yield positions[index], sequence, p
            index += 1
