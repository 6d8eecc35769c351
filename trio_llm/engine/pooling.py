"""The pooling engine core: embeddings from an encoder (or a decoder), batched continuously.

`PoolingCore` has `EngineCore`'s interface (``add_request``, ``abort``, ``step`` ...), so
the engine process, its loop, the IPC, the supervision and the API server's admission
treat it as they treat a generator: requests queue, each `step` runs one padded batch of
waiting prompts (up to ``max_num_seqs`` requests and ``max_num_batched_tokens`` padded
tokens) through the model, and every request of the batch finishes in that step with its
vector in `RequestOutput.embedding`. There is no KV cache: an embedding is one forward
pass. A cross-encoder (task ``score``) runs the same way: each input is a (query,
document) pair, and its "vector" is the pair's one score.

Which waiting inputs a step takes is `trio_llm.engine.pooling_queue`'s (shared fairly
between API requests); how a vector is made from the hidden states is
`trio_llm.engine.pooler`'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from trio_llm.config import EngineConfig, ModelConfig
from trio_llm.engine.model_info import ModelInfo
from trio_llm.engine.pooler import (
    PoolingSpec,
    cross_encoder_activation,
    is_sentence_transformers,
    pool,
)
from trio_llm.engine.pooling_queue import PoolingQueue, Waiting
from trio_llm.engine.request_queue import rank_of
from trio_llm.errors import EngineConfigError
from trio_llm.messages import (
    AddRequest,
    EngineReady,
    RequestOutput,
    Scheduling,
    StepOutputs,
    StepStats,
)

logger = logging.getLogger(__name__)


def uses_pooling(model: ModelConfig) -> bool:
    """Whether ``model`` runs as an embedding model (``runner``, or for ``auto`` whether
    its folder is a sentence-transformers folder)."""
    if model.runner != "auto":
        return model.runner == "pooling"
    from trio_llm.errors import ModelNotFoundError
    from trio_llm.model_files.loader import is_cross_encoder, locate_model

    try:
        path = locate_model(model.model)
    except ModelNotFoundError:
        return False  # the generating core reports it
    return path.is_dir() and (is_sentence_transformers(path) or is_cross_encoder(path))


class PoolingCore:
    """Continuous batching of embedding requests over one model (see the module doc).

    Args:
        model: a transformers base model (``AutoModel``) returning ``last_hidden_state``,
            or with ``activation`` a sequence-classification model returning ``logits``.
        spec: how its hidden states are pooled (unused for a cross-encoder).
        config: the engine configuration (``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``).
        model_dir: where the model came from (reported to the server).
        activation: for a cross-encoder, ``sigmoid`` or ``identity`` on its one logit
            (`cross_encoder_activation`); None for an embedding model.

    Raises:
        EngineConfigError: ``max_model_len`` longer than the model takes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: PoolingSpec,
        config: EngineConfig,
        model_dir: str,
        activation: str | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.config = config
        self.activation = activation
        #: ``embed`` (vectors) or ``score`` (a cross-encoder: one score per pair).
        self.task = "embed" if activation is None else "score"
        mconf = model.config
        limit = spec.max_seq_length or mconf.max_position_embeddings
        max_model_len = config.model.max_model_len or limit
        if max_model_len > mconf.max_position_embeddings:
            raise EngineConfigError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{mconf.max_position_embeddings}"
            )
        param = next(model.parameters())
        self.device = param.device
        self.pad_id = getattr(mconf, "pad_token_id", None) or 0
        self.info = ModelInfo(
            model_dir=model_dir,
            max_model_len=max_model_len,
            num_kv_blocks=0,
            block_size=0,
            eos_token_ids=frozenset(),
            vocab_size=mconf.vocab_size,
            dtype=str(param.dtype).removeprefix("torch."),
        )
        self.embedding_dim = int(mconf.hidden_size) if activation is None else 1
        self.num_token_types = int(getattr(mconf, "type_vocab_size", 1) or 1)
        #: Waiting inputs by group, in turn order (`PoolingQueue`).
        self.queue = PoolingQueue()
        #: Called by the engine loop's protocol (a generator's grammar compiles); unused.
        self.on_grammar_event: Any = None
        self._last_batch = (0, 0)
        if activation is not None:
            logger.info(
                "%s as a cross-encoder: (query, document) pairs scored by the %s of its "
                "logit, up to %d tokens a pair",
                type(model).__name__,
                activation,
                max_model_len,
            )
            return
        logger.info(
            "%s as an embedding model: %s pooling%s, %d dimensions, up to %d tokens",
            type(model).__name__,
            spec.mode,
            ", normalized" if spec.normalize else "",
            self.embedding_dim,
            max_model_len,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> PoolingCore:
        """Load the model named in ``config`` as an embedding model.

        Raises:
            trio_llm.errors.ModelNotFoundError: nothing loadable at ``config.model``.
            EngineConfigError: a pooling this core does not implement, or bad settings.
        """
        import transformers

        from trio_llm.model_files.dtype_choice import resolve_dtype
        from trio_llm.model_files.loader import is_cross_encoder, resolve_model_dir

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.model.weight_quantization is not None:
            raise EngineConfigError("--quantization applies to generating models only")
        model_dir = resolve_model_dir(config.model.model, config.cache_dir())
        cross = is_cross_encoder(model_dir)
        spec = PoolingSpec("cls_token", False) if cross else PoolingSpec.from_folder(model_dir)
        # float32 unless asked otherwise: the vectors are compared with the reference's.
        dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
        dtype = resolve_dtype(dtype, config.model.device)
        logger.info(f"loading {model_dir} ({dtype}, {config.model.device}) for pooling")
        auto = transformers.AutoModelForSequenceClassification if cross else transformers.AutoModel
        model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        activation = cross_encoder_activation(model_dir, model.config.num_labels) if cross else None
        model.to(config.model.device)
        model.eval()
        model.requires_grad_(False)
        return cls(model, spec, config, str(model_dir), activation)

    def ready_message(self, pid: int) -> EngineReady:
        """The `EngineReady` message describing this core (task ``embed``)."""
        info = self.info
        return EngineReady(
            model_dir=info.model_dir,
            max_model_len=info.max_model_len,
            num_kv_blocks=0,
            block_size=0,
            eos_token_ids=[],
            vocab_size=info.vocab_size,
            dtype=info.dtype,
            pid=pid,
            task=self.task,
            embedding_dim=self.embedding_dim,
            scheduling_policy=self.config.scheduler.scheduling_policy,
        )

    # ------------------------------------------------------------ requests

    def add_request(self, message: AddRequest) -> RequestOutput | None:
        """Queue a request; returns a finished-with-error output if it is rejected
        (empty, longer than ``max_model_len``, or a priority the policy does not serve)."""
        ids = message.prompt_token_ids
        error = None
        if not ids:
            error = "the input is empty"
        elif len(ids) > self.info.max_model_len:
            error = (
                f"the input has {len(ids)} tokens, more than this model's {self.info.max_model_len}"
            )
        elif not all(0 <= t < self.info.vocab_size for t in ids):
            error = f"token ids must be in [0, {self.info.vocab_size})"
        else:
            error = self._pair_error(message.params.second_text_start, len(ids))
            error = error or self._scheduling_error(message.scheduling)
        if error is not None:
            return RequestOutput(message.request_id, [], finish_reason="abort", error=error)
        group = message.group if message.group is not None else message.request_id
        policy = self.config.scheduler.scheduling_policy
        rank = rank_of(
            message.scheduling.batch,
            message.scheduling.priority,
            by_priority=policy == "priority",
        )
        split = message.params.second_text_start
        self.queue.add(Waiting(message.request_id, ids, time.monotonic(), group, rank, split))
        return None

    def _pair_error(self, second_text_start: int | None, length: int) -> str | None:
        """Why a pair's split cannot be served (not a cross-encoder, or outside the
        prompt), or None. A model without segment ids (RoBERTa's ``type_vocab_size`` 1)
        takes the pair as one segment, as transformers feeds it."""
        if second_text_start is None:
            return None
        if self.task != "score":
            return "second_text_start is for a cross-encoder (task score)"
        if not 0 < second_text_start < length:
            return f"second_text_start must be in (0, {length})"
        return None

    def _scheduling_error(self, scheduling: Scheduling) -> str | None:
        """Why the engine refuses ``scheduling`` (a priority under ``fcfs``), or None."""
        try:
            scheduling.validate(self.config.scheduler.scheduling_policy)
        except ValueError as exc:
            return str(exc)
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests if they still wait (unknown ids are ignored)."""
        self.queue.abort(request_ids)

    def pause(self, request_ids: list[str]) -> None:
        """Nothing to pause: a request's one output comes with its step."""

    def resume(self, request_ids: list[str]) -> None:
        """Nothing to resume (see `pause`)."""

    def has_unfinished_requests(self) -> bool:
        """True while any request waits."""
        return bool(self.queue.num_waiting)

    def has_work(self) -> bool:
        """True while any request waits."""
        return bool(self.queue.num_waiting)

    def close(self) -> None:
        """Nothing to release."""

    # ------------------------------------------------------------ the step

    def step(self) -> StepOutputs:
        """Embed one batch of waiting requests; each finishes with its vector."""
        start = time.perf_counter()
        scheduler = self.config.scheduler
        batch = self.queue.take_batch(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        outputs = []
        if batch:
            now = time.monotonic()
            vectors = self.embed([r.token_ids for r in batch], [r.second_text_start for r in batch])
            for request, vector in zip(batch, vectors.tolist(), strict=True):
                outputs.append(
                    RequestOutput(
                        request.request_id,
                        [],
                        finish_reason="stop",
                        queue_seconds=now - request.arrival,
                        embedding=vector,
                    )
                )
        self._last_batch = (len(batch), sum(len(r.token_ids) for r in batch))
        return StepOutputs(outputs, self.stats(time.perf_counter() - start))

    @torch.inference_mode()
    def embed(
        self, prompts: list[list[int]], second_starts: list[int | None] | None = None
    ) -> torch.Tensor:
        """The vectors of ``prompts`` (token ids), run as one right-padded batch; for a
        cross-encoder each prompt is a pair, its second text from ``second_starts[i]``
        (segment 1 from there; None: one segment), and its vector its one score.

        Returns:
            ``[len(prompts), embedding_dim]`` float32 on the CPU.
        """
        longest = max(map(len, prompts))
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.activation is None:
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            return pool(hidden, mask, self.spec).cpu()
        kwargs = {}
        if self.num_token_types > 1:  # BERT's segment ids: 0, then 1 from the second text
            types = torch.zeros_like(ids)
            for row, start in enumerate(second_starts or []):
                if start is not None:
                    types[row, start : len(prompts[row])] = 1
            kwargs["token_type_ids"] = types
        logits = self.model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()
        return (torch.sigmoid(logits) if self.activation == "sigmoid" else logits).cpu()

    def stats(self, step_seconds: float = 0.0) -> StepStats:
        """Queue state now, with the counts of the batch a step just ran."""
        num_reqs, num_tokens = self._last_batch if step_seconds else (0, 0)
        return StepStats(
            num_running=0,
            num_waiting=self.queue.num_waiting,
            num_scheduled_reqs=num_reqs,
            num_scheduled_tokens=num_tokens,
            num_prefill_tokens=num_tokens,
            num_free_blocks=0,
            num_preemptions=0,
            step_seconds=step_seconds,
        )

    def warm_up(self) -> None:
        """Run one small batch through the model."""
        self.embed([[self.pad_id] * 4, [self.pad_id] * 2])
