"""Every message type that crosses a process boundary.

Hot-path messages are msgspec structs encoded as MessagePack (compact, typed, no pickle),
each tagged so one decoder reads the union of what a peer may send. The only pickled
payload is the start-up `EngineConfig`, sent once over the same private socket.

Direction          Messages
server -> engine   `AddRequest`, `AbortRequests`, `PauseRequests`, `ResumeRequests`,
                   `HealthCheck`, `Shutdown`
engine -> server   `EngineReady`, `StepOutputs`, `Heartbeat`, `HealthReply`, `EngineFailed`

In 3-process mode (``--detokenizer-mode process``) the detokenizer child sits between the
two and speaks the same messages on both sides: it forwards what the server sends and
fills in `RequestOutput.text` and ``stop_reason`` on the way back.
"""

from __future__ import annotations

import msgspec

#: Temperatures below this sample greedily: dividing logits by less overflows float32.
GREEDY_TEMPERATURE = 1e-5

#: Smallest ``repetition_penalty``: positive logits are divided by it, and a much smaller
#: one overflows float32 (the distribution then turns into NaNs).
MIN_REPETITION_PENALTY = 0.01

#: Presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range).
MAX_PENALTY = 2

#: ``logit_bias`` values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0

#: `StructuredOutput.kind` values.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class LoraRef(msgspec.Struct, frozen=True, array_like=True):
    """The LoRA adapter a request runs with (`trio_llm.lora_files`): its served ``name``,
    its folder and the ``digest`` of its files (the engine refuses files that changed)."""

    name: str
    path: str
    digest: str


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on a request's output, enforced token by token (vLLM's
    ``structured_outputs``).

    Attributes:
        kind: ``"json"`` (``spec`` is a JSON Schema, as JSON text), ``"json_object"``
            (any JSON object; ``spec`` unused), ``"regex"`` (``spec`` is a regular
            expression the whole output matches), ``"choice"`` (``spec`` is a JSON list
            of strings, the output is one of them) or ``"grammar"`` (``spec`` is a Lark
            grammar, llguidance's dialect).
        spec: the schema, expression, choices or grammar.
        prefix: Lark rules (llguidance's dialect) defining the rule ``reasoning``, a part
            of the output before the constrained one: the model's reasoning up to its end
            tag, with a ``--reasoning-parser`` (`trio_llm.text.reasoning`); the server
            writes it, never a client. Empty: the constraint holds from the first token.
    """

    kind: str
    spec: str = ""
    prefix: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the engine picks each output token and when it stops (a subset of vLLM's).

    Logits are processed in this order (as vLLM does): ``logit_bias`` is added, EOS and
    ``stop_token_ids`` are masked while fewer than ``min_tokens`` were generated, then the
    repetition, frequency and presence penalties, then temperature, then the ``min_p``,
    ``top_k`` and ``top_p`` truncations. The token is drawn from the softmax of the result,
    and reported logprobs are the log-softmax of that same result.

    The engine core ignores ``stop``, ``include_stop_str_in_output`` and
    ``skip_special_tokens``: whichever process detokenizes reads them (the API server,
    or the detokenizer child in 3-process mode).

    Attributes:
        max_tokens: most output tokens to generate. 0 computes the prompt (and its
            logprobs) and finishes with "length" without sampling.
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
        temperature: softmax temperature; 0 (or below 1e-5) means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens below ``min_p`` times the top token's probability; 0 disables it.
        presence_penalty: subtracted once from every output token's logit, in [-2, 2].
        frequency_penalty: subtracted once per occurrence in the output, in [-2, 2].
        repetition_penalty: tokens in the prompt or output have positive logits divided
            and negative logits multiplied by it (CTRL paper); 1 disables it. At least
            `MIN_REPETITION_PENALTY` (the HTTP API also caps it at 2, as vLLM does).
        logit_bias: ``(token_id, bias)`` pairs added to the logits; biases in [-100, 100].
        seed: per-request random seed: the draws do not depend on what else is in the
            batch. In float32 on the CPU the output then does not either; in bfloat16 the
            logits can (docs/api.md, "Batch invariance").
        stop_token_ids: token ids that end generation (finish_reason "stop"), besides EOS.
        ignore_eos: keep generating past EOS (benchmarks use it for a fixed output length).
        logprobs: report the sampled token's logprob plus this many most likely
            alternatives per output token; None reports nothing.
        prompt_logprobs: report each prompt token's logprob (from the second one on) plus
            this many alternatives; None reports nothing.
        stop: strings that end the output (finish_reason "stop", stop_reason the string);
            found across token boundaries; the stop string itself is left out of the text.
        include_stop_str_in_output: keep the matched stop string (or stop token's text).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
        structured_output: constrain the output to a JSON Schema, a regex, a choice or a
            grammar (`StructuredOutput`); None: unconstrained.
        cache_salt: vLLM's ``cache_salt``: requests share prefix-cache blocks only with
            requests of the same salt (None: with those without one).
        second_text_start: a cross-encoder's pair (task ``score``): where its second text
            starts, segment (``token_type_ids``) 1 from there; None: one segment.
        lora: the LoRA adapter to apply (its KV blocks are shared only with requests of
            the same adapter); None: the base model.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    cache_salt: str | None = None
    second_text_start: int | None = None
    lora: LoraRef | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field that is out of range.

        Args:
            vocab_size: when given, token ids in ``logit_bias`` and ``stop_token_ids`` and
                the logprob counts are checked against it.
        """
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be non-negative")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be non-negative")
        if self.max_tokens and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if not self.temperature >= 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or positive")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2**31:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2**31]")
        if any(not stop for stop in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            raise ValueError(
                f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative")
        so = self.structured_output
        if so is not None and so.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(f"structured_output.kind must be one of {STRUCTURED_OUTPUT_KINDS}")
        if vocab_size is None:
            return
        ids = [token for token, _ in self.logit_bias] + list(self.stop_token_ids)
        if any(not 0 <= token < vocab_size for token in ids):
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must not exceed the vocabulary size {vocab_size}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


# ---------------------------------------------------------------- server -> engine


class Scheduling(msgspec.Struct, frozen=True, array_like=True):
    """Where an engine request stands in line (`trio_llm.engine.request_queue`).

    Attributes:
        priority: vLLM's ``priority``: any integer, lower is handled earlier; served only
            under the ``priority`` scheduling policy (`validate`).
        batch: the request is background batch work (the *batch lane*): it ranks after
            every interactive request whatever the policy and priorities, and while
            interactive requests wait the batch lane holds at most
            ``SchedulerConfig.max_batch_share`` of the batch slots.
        data_parallel_rank: the engine of ``--data-parallel-size N`` that serves the
            request (vLLM's ``X-data-parallel-rank`` header), or None: the front end's
            router chooses (`trio_llm.frontend.data_parallel`). Read by the front end only.
    """

    priority: int = 0
    batch: bool = False
    data_parallel_rank: int | None = None

    def validate(self, policy: str) -> None:
        """Raise ValueError (vLLM's refusal) for a nonzero priority under a ``policy``
        other than ``priority``."""
        if self.priority != 0 and policy != "priority":
            raise ValueError(
                f"priority scheduling is not enabled (scheduling policy {policy!r}): "
                f"priority must be 0, got {self.priority}"
            )


#: An interactive request of priority 0 (every request that says nothing else).
DEFAULT_SCHEDULING = Scheduling()


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a new request. ``prompt_token_ids`` is non-empty and fits the context.

    Attributes:
        group: shared by the engine requests of one API request (its ``n`` choices and
            batch prompts); the scheduler shares batch slots fairly between groups. None:
            a group of its own.
        scheduling: its priority and lane (the same for every request of a group).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None = None
    scheduling: Scheduling = DEFAULT_SCHEDULING


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Drop these requests wherever they are (waiting or running) and free their KV blocks.

    Unknown or already finished ids are ignored.
    """

    request_ids: list[str]


class PauseRequests(msgspec.Struct, tag="pause", array_like=True):
    """Stop scheduling these requests: their consumer is not reading its output.

    A paused request leaves the running batch at once (its KV blocks are freed; with
    prefix caching their full blocks stay reusable) and is recomputed when resumed. It
    still counts as unfinished; `AbortRequests` ends it. Unknown ids are ignored.
    """

    request_ids: list[str]


class ResumeRequests(msgspec.Struct, tag="resume", array_like=True):
    """Schedule these paused requests again (their consumer read its output)."""

    request_ids: list[str]


class HealthCheck(msgspec.Struct, tag="health", array_like=True):
    """Answer with a `HealthReply` of the same ``seq``.

    The engine's main loop answers it, between steps, after every message sent before it:
    a reply proves the whole path works (the server's writes, the engine's reader, its
    loop, its writes; in 3-process mode the detokenizer's relay both ways), which a
    `Heartbeat` (sent by a task of its own) does not.
    """

    seq: int


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
        task: ``"generate"``, or for `trio_llm.engine.pooling` (outputs carry vectors)
            ``"embed"`` (an embedding model) or ``"score"`` (a cross-encoder: 1 score).
        embedding_dim: length of the vectors of a pooling model (0 otherwise).
        scheduling_policy: the engine's ``--scheduling-policy`` (``fcfs`` or
            ``priority``): the server refuses a nonzero ``priority`` unless ``priority``.
    """

    model_dir: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int
    dtype: str
    pid: int
    task: str = "generate"
    embedding_dim: int = 0
    scheduling_policy: str = "fcfs"


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position of a sequence (natural log, float32 precision).

    Attributes:
        token_id: the token at this position (sampled, or the prompt's).
        logprob: its log-probability; ``-inf`` when the processed distribution excludes it.
        rank: 1 + the number of tokens with a strictly higher logprob.
        top_token_ids: the most likely tokens, best first (as many as were asked for).
        top_logprobs: their log-probabilities, same order.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, array_like=True):
    """What one step produced for one request.

    Attributes:
        request_id: the id given in `AddRequest`.
        new_token_ids: tokens sampled this step (usually one; empty on an error, mid
            prefill (first scheduling, prompt logprobs) or for ``max_tokens=0``).
        finish_reason: None while running; "stop" (EOS or a stop token), "length"
            (max_tokens or the context is full) or "abort" (error or abort).
        error: why the engine rejected the request (only with finish_reason "abort").
        logprobs: one entry per new token when ``SamplingParams.logprobs`` is set.
        prompt_logprobs: entries for prompt positions computed this step (position 1 on;
            position 0 has no logprob) when ``SamplingParams.prompt_logprobs`` is set.
        queue_seconds: on the request's first output only: seconds from its arrival in
            the engine to its first scheduling (monotonic clock of the engine process).
        num_cached_tokens: on the first output only: prompt tokens whose KV came from the
            prefix cache at the first scheduling (vLLM's field).
        text: None from the engine core. From the detokenizer child: the text released
            by these tokens (held-back text comes later), and ``logprobs`` then holds the
            entries of exactly the tokens behind that text.
        stop_reason: set by the detokenizer child with finish_reason "stop": the matched
            stop string or stop token id (None for EOS).
        embedding: from an embedding model (``EngineReady.task == "embed"``), with the
            request's finishing output: its vector (float32 values).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    queue_seconds: float | None = None
    text: str | None = None
    stop_reason: str | int | None = None
    embedding: list[float] | None = None
    num_cached_tokens: int | None = None


class StepStats(msgspec.Struct, array_like=True):
    """Scheduler state after one step (counts of requests and tokens).

    ``prefix_cache_queries`` / ``_hits``: running totals of prompt tokens looked up in the
    prefix cache and found there. ``num_paused``: requests whose consumer is not reading.
    ``disk_*``: running totals of the prefix cache's tier on disk (`TierCounters`).
    """

    num_running: int
    num_waiting: int
    num_scheduled_reqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_free_blocks: int
    num_preemptions: int
    step_seconds: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_paused: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_evicted: int = 0
    disk_refused: int = 0
    disk_dropped: int = 0


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One engine step: every request that produced a token or finished, and stats."""

    outputs: list[RequestOutput]
    stats: StepStats


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The engine's event loop is alive; sent every `EngineConfig.heartbeat_interval` seconds.
    The engine is hung when nothing arrived for ``--engine-step-timeout`` seconds, or
    ``step_seconds`` exceeds it (a step stuck in a kernel).

    Attributes:
        step_seconds: how long the step now computing has been running (seconds,
            monotonic clock of the engine process); 0 when no step is running.
    """

    step_seconds: float


class HealthReply(msgspec.Struct, tag="health_reply", array_like=True):
    """The answer to the `HealthCheck` with this ``seq``."""

    seq: int


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine hit an error it cannot recover from; it exits right after sending this."""

    message: str


ToEngine = AddRequest | AbortRequests | PauseRequests | ResumeRequests | HealthCheck | Shutdown
FromEngine = EngineReady | StepOutputs | Heartbeat | HealthReply | EngineFailed
