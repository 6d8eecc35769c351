"""One request's grammar failing inside the engine ends that request only (vLLM
CVE-2026-105757 killed the shared engine core this way): `EngineCore.step()` does not
raise, a request in the same batch gets the tokens it gets alone, and the next request
is served. The grammar library is played by test doubles that raise where a bug could:
starting the compile, the compile itself, copying the compiled matcher, filling the mask,
consuming the token, asking whether the grammar is complete."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.tiny_model import build_tiny_model
from trio_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from trio_llm.engine import grammar_masks
from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.core import EngineCore
from trio_llm.engine.grammar_compiler import GrammarCompile, GrammarCompiler
from trio_llm.messages import AddRequest, SamplingParams, StructuredOutput
from trio_llm.structured_output.grammar_check import llguidance_numpy

#: Runs an engine core (in this process, a real model forward pass per step): the slow tier.
pytestmark = pytest.mark.slow

WHERE = ["start", "compile", "copy", "fill", "consume", "stop"]
PROMPT = [5, 6, 7, 8]


class Broken(RuntimeError):
    """What the doubles raise."""


class BrokenMatcher:
    """An llguidance matcher that allows every token and raises at ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def deep_copy(self) -> BrokenMatcher:
        if self.where == "copy":
            raise Broken("copy")
        return self

    def fill(self, bitmask: Any, index: int) -> None:
        if self.where == "fill":
            raise Broken("fill")
        bitmask[index] = -1

    def consume_token(self, token: int) -> bool:
        if self.where == "consume":
            raise Broken("consume")
        return True

    def is_error(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        if self.where == "stop":
            raise Broken("stop")
        return False


class FakeNumpy:
    """llguidance.numpy's two functions the masks use, filling through the doubles."""

    @staticmethod
    def allocate_token_bitmask(rows: int, vocab: int) -> Any:
        return llguidance_numpy().allocate_token_bitmask(rows, vocab)

    @staticmethod
    def fill_next_token_bitmask(matcher: BrokenMatcher, bitmask: Any, index: int) -> None:
        matcher.fill(bitmask, index)


def fake_compile(self: GrammarCompiler, spec: StructuredOutput) -> GrammarCompile:
    """`GrammarCompiler.compile` whose outcome is the double named by ``spec.spec``."""
    if spec.spec == "start":
        raise Broken("start")
    job = GrammarCompile((spec.kind, spec.spec, spec.prefix))
    job.waiters = 1
    if spec.spec == "compile":
        job.future.set_exception(Broken("compile"))
    else:
        job.future.set_result(BrokenMatcher(spec.spec))  # type: ignore[arg-type]
    return job


@pytest.fixture(autouse=True)
def doubles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GrammarCompiler, "compile", fake_compile)
    monkeypatch.setattr(grammar_masks, "llguidance_numpy", lambda: FakeNumpy)


def _core() -> EngineCore:
    model = build_tiny_model(seed=0)
    model.set_attn_implementation(ATTENTION_NAME)
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
    )
    return EngineCore(model, config, "tiny")


def _params(where: str | None = None) -> SamplingParams:
    structured = StructuredOutput("regex", where) if where else None
    return SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, structured_output=structured
    )


def _run(core: EngineCore, requests: dict[str, SamplingParams]) -> dict[str, Any]:
    """Add ``requests`` at once and step until all ended: tokens, finish and error each."""
    ended: dict[str, Any] = {name: {"tokens": []} for name in requests}
    for name, params in requests.items():
        refused = core.add_request(AddRequest(name, PROMPT, params))
        if refused is not None:
            ended[name].update(finish=refused.finish_reason, error=refused.error)
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            ended[output.request_id]["tokens"] += output.new_token_ids
            if output.finish_reason is not None:
                ended[output.request_id].update(finish=output.finish_reason, error=output.error)
    return ended


@pytest.fixture(scope="module")
def alone() -> list[int]:
    """The healthy request's tokens on an engine of its own."""
    return _run(_core(), {"ok": _params()})["ok"]["tokens"]


@pytest.mark.parametrize("where", WHERE)
def test_a_grammar_failing_ends_its_request_only(where: str, alone: list[int]) -> None:
    core = _core()
    ended = _run(core, {"ok": _params(), "bad": _params(where)})
    assert ended["bad"]["finish"] == "abort"
    assert ended["bad"]["error"] == "structured output: internal error in the grammar (Broken)"
    assert ended["ok"] == {"tokens": alone, "finish": "length", "error": None}
    # The engine serves on: the next request, and the failed one's place is free.
    after = _run(core, {"next": _params()})
    assert after["next"] == {"tokens": alone, "finish": "length", "error": None}
    assert core.scheduler.num_unfinished == 0
