"""A request whose consumer stops reading is paused in the engine, and resumed when it reads.

The engine is played by the test over an in-memory stream (tests/unit/conftest.py's
FakeEngine), so the messages the client sends are seen exactly.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.unit.conftest import FakeEngine, engine_client_pair
from trio_llm.frontend.engine_client import PAUSE_AFTER_UNREAD_TOKENS
from trio_llm.messages import (
    AddRequest,
    EngineReady,
    PauseRequests,
    ResumeRequests,
    SamplingParams,
)

INFO = EngineReady("/model", 4096, 64, 16, [2], 49152, "float32", 1)


async def test_unread_output_pauses_the_request_and_reading_resumes_it() -> None:
    client, stream = engine_client_pair(INFO)
    engine = FakeEngine(stream)
    params = SamplingParams(max_tokens=1000)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.route_outputs)
            nursery.start_soon(engine.run)
            async with client.open_requests([([1], params), ([2], params)]) as (slow, fast):
                added = [await engine.wait_for(AddRequest) for _ in range(2)]
                # The two choices of one API request share a group.
                assert added[0].group == added[1].group == slow.request_id
                # Just under the limit: nothing happens.
                await engine.tokens(slow.request_id, PAUSE_AFTER_UNREAD_TOKENS - 1)
                await engine.tokens(fast.request_id, 1)
                assert (await fast.__anext__()).token_ids == [28]
                assert not any(isinstance(m, PauseRequests) for m in engine.received)
                # One more unread token pauses it.
                await engine.tokens(slow.request_id, 1)
                paused = await engine.wait_for(PauseRequests)
                assert paused.request_ids == [slow.request_id]
                assert client.num_pauses == 1
                # Reading takes every token that arrived and resumes it.
                delta = await slow.__anext__()
                assert len(delta.token_ids) == PAUSE_AFTER_UNREAD_TOKENS
                resumed = await engine.wait_for(ResumeRequests)
                assert resumed.request_ids == [slow.request_id]
                # A reader that keeps up is never paused again.
                for _ in range(3):
                    await engine.tokens(slow.request_id, 10)
                    read = 0
                    while read < 10:
                        read += len((await slow.__anext__()).token_ids)
                assert client.num_pauses == 1
            nursery.cancel_scope.cancel()
