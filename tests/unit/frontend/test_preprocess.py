"""The prompt-to-request layer shared by HTTP, WebSocket and the embedding API."""

import pytest
import trio

from trio_llm.errors import EngineDeadError, InvalidRequest
from trio_llm.frontend.preprocess import INLINE_ENCODE_CHARS, InputPreprocessor, fan_out
from trio_llm.frontend.request_stream import run_all
from trio_llm.messages import SamplingParams


@pytest.fixture
def inputs(smol_tokenizer) -> InputPreprocessor:
    return InputPreprocessor(smol_tokenizer, max_model_len=64, vocab_size=49152)


def test_refusals_name_the_parameter(inputs: InputPreprocessor) -> None:
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens") as info:
        inputs.encode("x" * 100_000, "messages", special_tokens=False)
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as info:
        inputs.encode("a\ud800b", "prompt", special_tokens=True)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="token id 49152 is out of range") as info:
        inputs.check_token_ids([1, 49152], "stop_token_ids")
    assert info.value.param == "stop_token_ids"
    # A max_tokens past the room left is clamped to it (the default policy).
    assert inputs.output_budget(60, 10).tokens == 54
    with pytest.raises(InvalidRequest) as info:
        inputs.output_budget(None, 64, prompt_param="messages")
    assert info.value.param == "messages"
    assert isinstance(info.value, ValueError)  # what the embedding API raises


def test_token_ids_must_be_integers(inputs: InputPreprocessor) -> None:
    assert inputs.check_token_ids([1, 2]) == [1, 2]
    with pytest.raises(TypeError, match="not bool"):
        inputs.check_token_ids([1, True])
    with pytest.raises(TypeError, match="holds a str"):
        inputs.check_token_ids([1, "2"])


def test_long_texts_encode_the_same_off_the_loop(smol_tokenizer) -> None:
    inputs = InputPreprocessor(smol_tokenizer, max_model_len=100_000, vocab_size=49152)
    text = "The quick brown fox jumps over the lazy dog. " * (INLINE_ENCODE_CHARS // 40)
    assert len(text) >= INLINE_ENCODE_CHARS

    async def main() -> list[int]:
        return await inputs.encode_async(text, "prompt", special_tokens=True)

    assert trio.run(main) == smol_tokenizer.encode(text, add_special_tokens=True)


def test_fan_out_seeds_each_sample() -> None:
    params = SamplingParams(max_tokens=3, seed=2**63 - 1)
    samples = fan_out(params, 3)
    assert [s.seed for s in samples] == [2**63 - 1, -(2**63), -(2**63) + 1]
    assert {s.max_tokens for s in samples} == {3}
    assert fan_out(params, 1) == [params]
    assert [s.seed for s in fan_out(SamplingParams(), 2)] == [None, None]


def test_run_all_ends_every_job_at_the_first_engine_error() -> None:
    cancelled: list[int] = []

    async def waits(index: int) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(index)
            raise

    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise EngineDeadError("gone")

    async def main() -> None:
        await run_all([lambda: waits(0), fails, lambda: waits(2)])

    with pytest.raises(EngineDeadError, match="gone"):
        trio.run(main)
    assert sorted(cancelled) == [0, 2]
