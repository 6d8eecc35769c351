"""`EngineCoreProtocol`: what the engine process's loop (`trio_llm.engine.loop`) calls on
its core, a generating `trio_llm.engine.core.EngineCore` or an embedding
`trio_llm.engine.pooling.PoolingCore` (typing only).

The loop applies the server's messages between steps (`add_request`, `abort`, `pause`,
`resume`), runs `step` in a worker thread while `has_work`, and reports `stats` when the
batch empties without a step. Everything but `step` runs on the Trio thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from trio_llm.messages import AddRequest, EngineReady, RequestOutput, StepOutputs, StepStats


class EngineCoreProtocol(Protocol):
    """One engine core, as the engine loop drives it.

    Attributes:
        on_grammar_event: set by the loop; called (from any thread) when a structured
            output's grammar compile starts, finishes or times out, so that the loop's
            wait for a message ends. A core without grammars never calls it.
    """

    on_grammar_event: Callable[[], None] | None

    def ready_message(self, pid: int) -> EngineReady:
        """The `EngineReady` describing this core (sent once, after the warm-up)."""
        ...

    def add_request(self, message: AddRequest) -> RequestOutput | None:
        """Queue a request; returns a finished-with-error output if it is rejected."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests and free their KV blocks; unknown ids are ignored."""
        ...

    def pause(self, request_ids: list[str]) -> None:
        """Stop scheduling these requests until `resume`."""
        ...

    def resume(self, request_ids: list[str]) -> None:
        """Schedule paused requests again; unknown ids are ignored."""
        ...

    def has_work(self) -> bool:
        """True while a step would do something."""
        ...

    def step(self) -> StepOutputs:
        """Run one step (in a worker thread) and report its outputs."""
        ...

    def stats(self) -> StepStats:
        """Queue (and cache) state now, with no step's counts."""
        ...

    def close(self) -> None:
        """Release the core's threads; it must not be used afterwards."""
        ...
