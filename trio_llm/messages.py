"""Every message type that crosses a process boundary.

Hot-path messages are msgspec structs encoded as MessagePack (compact, typed, no pickle).
Each is tagged so one decoder reads the union of what a peer may send. The only pickled
payload is the start-up `EngineConfig`, sent once over the same private socket.

Direction          Messages
server -> engine   `AddRequest`, `AbortRequests`, `Shutdown`
engine -> server   `EngineReady`, `StepOutputs`, `EngineFailed`
"""

from __future__ import annotations

import msgspec

#: Temperatures below this sample greedily: dividing logits by less overflows float32.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick each output token and when to stop (a subset of vLLM's SamplingParams).

    Attributes:
        max_tokens: most output tokens to generate (>= 1).
        temperature: softmax temperature; 0 (or below 1e-5) means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request random seed; with a seed the output does not depend on what
            else is in the batch.
        stop_token_ids: token ids that end generation (finish_reason "stop"), in addition
            to the model's EOS ids.
        ignore_eos: keep generating past EOS (benchmarks use it for a fixed output length).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or positive")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


# ---------------------------------------------------------------- server -> engine


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a new request. ``prompt_token_ids`` is non-empty and fits the context."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Drop these requests wherever they are (waiting or running) and free their KV blocks.

    Unknown or already finished ids are ignored.
    """

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish the current step, then exit with status 0."""


# ---------------------------------------------------------------- engine -> server


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded and a warm-up step ran; the engine accepts requests.

    Attributes:
        model_dir: folder holding the tokenizer and config (a converted cache for GGUF).
        max_model_len: context length in tokens.
        num_kv_blocks: KV blocks in the cache; ``block_size`` tokens each.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        dtype: torch dtype name of the weights.
        pid: the engine process id.
    """

    model_dir: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int
    dtype: str
    pid: int


class RequestOutput(msgspec.Struct, array_like=True):
    """What one step produced for one request.

    Attributes:
        request_id: the id given in `AddRequest`.
        new_token_ids: tokens sampled this step (usually one; empty on an error).
        finish_reason: None while running; "stop" (EOS or a stop token), "length"
            (max_tokens or the context is full) or "abort" (error or abort).
        error: why the engine rejected the request (only with finish_reason "abort").
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


class StepStats(msgspec.Struct, array_like=True):
    """Scheduler state after one step (counts of requests and tokens)."""

    num_running: int
    num_waiting: int
    num_scheduled_reqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_free_blocks: int
    num_preemptions: int
    step_seconds: float


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One engine step: every request that produced a token or finished, and stats."""

    outputs: list[RequestOutput]
    stats: StepStats


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine hit an error it cannot recover from; it exits right after sending this."""

    message: str


ToEngine = AddRequest | AbortRequests | Shutdown
FromEngine = EngineReady | StepOutputs | EngineFailed
