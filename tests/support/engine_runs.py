"""Running one request through an `EngineCore` in the test's own thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trio_llm.messages import AddRequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from trio_llm.engine.core import EngineCore


def run_request(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Add the request ``"r"`` and step ``core`` until nothing is left unfinished; the
    outputs, in order (each asserted to carry no error)."""
    core.add_request(AddRequest("r", prompt, params))
    outputs: list[RequestOutput] = []
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            assert output.error is None, output.error
            outputs.append(output)
    return outputs
