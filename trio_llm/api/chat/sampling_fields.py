"""The sampling fields of a generation request as pydantic types, bounded by the ranges
`trio_llm.messages.SamplingParams` accepts (its constants, not restated numbers), and
tighter where the HTTP API is (``repetition_penalty`` at most 2, as vLLM's).

``None`` (the field not given) is left to `trio_llm.api.chat.generation_request`, which fills in
the server's defaults.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt

from trio_llm.api.chat.request_body import INT32_MAX, FiniteFloat
from trio_llm.messages import MAX_PENALTY, MIN_REPETITION_PENALTY

#: Largest ``repetition_penalty`` (vLLM's bound; the engine itself takes larger ones).
MAX_REPETITION_PENALTY = 2.0

#: ``temperature``: 0 (greedy) or more.
Temperature = Annotated[FiniteFloat, Field(ge=0)]
#: ``top_p``: the nucleus mass, in (0, 1].
TopP = Annotated[FiniteFloat, Field(gt=0, le=1)]
#: ``top_k`` (vLLM's): -1 or 0 disables it.
TopK = Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)]
#: ``min_p`` (vLLM's), in [0, 1].
MinP = Annotated[FiniteFloat, Field(ge=0, le=1)]
#: ``presence_penalty`` and ``frequency_penalty``.
Penalty = Annotated[FiniteFloat, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
#: ``repetition_penalty`` (vLLM's).
RepetitionPenalty = Annotated[
    FiniteFloat, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
]
