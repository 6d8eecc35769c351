"""The pooling engine core: embeddings from an encoder (or a decoder), batched continuously.

`PoolingCore` has `EngineCore`'s interface (``add_request``, ``abort``, ``step`` ...), so
the engine process, its loop, the IPC, the supervision and the API server's admission
treat it as they treat a generator: requests queue, each `step` runs one padded batch of
waiting prompts (up to ``max_num_seqs`` requests and ``max_num_batched_tokens`` padded
tokens) through the model, and every request of the batch finishes in that step with its
vector in `RequestOutput.embedding`. There is no KV cache: an embedding is one forward
pass.

The steps are shared fairly between API requests: the inputs of one API request share a
*group* (`AddRequest.group`), and each step is led by the next group in turn (groups take
their turn in the order they arrived; the group that led goes behind every group waiting
then). The leader's inputs come first, packed by similar length; the room they leave is
filled with other groups' inputs of the most similar lengths, none much longer than the
leader's (`PoolingCore._take_batch`). So one request of 2,048 inputs leads one step in
each round and cannot keep a one-input request waiting for more than about a step (the
one running when it arrives, then its own, short one), and no input waits for ever.

How a vector is made follows the model folder:

- a sentence-transformers folder (``modules.json``): the Transformer module (the folder
  itself), then its ``Pooling`` module (``1_Pooling/config.json``: CLS, mean, max,
  mean-sqrt-len or last token) and, if listed, ``Normalize`` (unit L2 norm). Other
  modules (``Dense`` projections, for one) are refused at start-up, since leaving them out
  would give other vectors than sentence-transformers does. ``max_seq_length`` of
  ``sentence_bert_config.json`` is the context length.
- any other folder (``--runner pooling`` on a language model): the base model's last
  hidden state at the last token, L2-normalized (vLLM's default for decoders).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from trio_llm.config import EngineConfig, ModelConfig
from trio_llm.engine.core import ModelInfo
from trio_llm.errors import EngineConfigError
from trio_llm.messages import AddRequest, EngineReady, RequestOutput, StepOutputs, StepStats

logger = logging.getLogger(__name__)

#: A pooling step picks its leader's inputs among the group's oldest ``BATCH_WINDOW *
#: max_num_seqs``, and the inputs that fill the rest of the batch among as many of the other
#: groups' (by similar length; `PoolingCore._take_batch`).
BATCH_WINDOW = 4

#: Other groups' inputs fill a step's room only up to this many times the length of its
#: leader's longest input, so that a short request's step stays short (a one-input
#: request is not padded to the length of a large request beside it).
FILL_LENGTH_FACTOR = 2

#: sentence-transformers pooling modes this core implements (``pooling_mode_<name>``).
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")


def is_sentence_transformers(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a sentence-transformers folder (it has ``modules.json``)."""
    return (Path(model_dir) / "modules.json").is_file()


def uses_pooling(model: ModelConfig) -> bool:
    """Whether ``model`` runs as an embedding model (``runner``, or for ``auto`` whether
    its folder is a sentence-transformers folder)."""
    if model.runner != "auto":
        return model.runner == "pooling"
    from trio_llm.errors import ModelNotFoundError
    from trio_llm.model_loader import locate_model

    try:
        path = locate_model(model.model)
    except ModelNotFoundError:
        return False  # the generating core reports it
    return path.is_dir() and is_sentence_transformers(path)


@dataclass(frozen=True)
class PoolingSpec:
    """How hidden states become one vector.

    Attributes:
        mode: one of `POOLING_MODES`.
        normalize: scale the vector to unit L2 norm.
        max_seq_length: longest input in tokens, or None for the model's
            ``max_position_embeddings``.
    """

    mode: str
    normalize: bool
    max_seq_length: int | None = None

    @classmethod
    def from_folder(cls, model_dir: Path) -> PoolingSpec:
        """Read a model folder's pooling (see the module doc).

        Raises:
            EngineConfigError: a sentence-transformers module or pooling mode this core
                does not implement.
        """
        model_dir = Path(model_dir)
        if not is_sentence_transformers(model_dir):
            return cls("lasttoken", True)
        modules = json.loads((model_dir / "modules.json").read_text())
        mode, normalize = None, False
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            path = model_dir / module.get("path", "")
            if kind == "Transformer" and module.get("path", "") == "":
                continue
            if kind == "Pooling":
                mode = _pooling_mode(json.loads((path / "config.json").read_text()))
            elif kind == "Normalize":
                normalize = True
            else:
                raise EngineConfigError(
                    f"the sentence-transformers module {module.get('type')!r} "
                    f"({module.get('path')}) is not supported; trio-llm runs Transformer (in the "
                    "folder itself), Pooling and Normalize only"
                )
        if mode is None:
            raise EngineConfigError(f"{model_dir}/modules.json lists no Pooling module")
        max_len = None
        bert_config = model_dir / "sentence_bert_config.json"
        if bert_config.is_file():
            max_len = json.loads(bert_config.read_text()).get("max_seq_length")
        return cls(mode, normalize, max_len)


def _pooling_mode(config: dict[str, Any]) -> str:
    on = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")]
    others = [
        key.removeprefix("pooling_mode_")
        for key, value in config.items()
        if key.startswith("pooling_mode_") and value and key[13:] not in POOLING_MODES
    ]
    if others or len(on) != 1:
        raise EngineConfigError(
            f"pooling {on + others} is not supported: one of {list(POOLING_MODES)} must be on"
        )
    return on[0]


def pool(hidden: torch.Tensor, mask: torch.Tensor, spec: PoolingSpec) -> torch.Tensor:
    """One vector per row of a padded batch.

    Args:
        hidden: ``[batch, seq, hidden]`` last hidden states.
        mask: ``[batch, seq]``, 1 for real tokens and 0 for padding (right-padded).
        spec: the pooling.

    Returns:
        ``[batch, hidden]`` float32 vectors (unit norm with ``spec.normalize``).
    """
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    lengths = mask.sum(dim=1)
    if spec.mode == "cls_token":
        out = hidden[:, 0]
    elif spec.mode == "lasttoken":
        out = hidden[torch.arange(hidden.shape[0]), lengths - 1]
    elif spec.mode == "max_tokens":
        out = hidden.masked_fill(weights == 0, float("-inf")).amax(dim=1)
    else:
        summed = (hidden * weights).sum(dim=1)
        counts = lengths.unsqueeze(-1).to(hidden.dtype).clamp(min=1e-9)
        out = summed / (counts if spec.mode == "mean_tokens" else counts.sqrt())
    if spec.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=1)
    return out


@dataclass
class _Waiting:
    request_id: str
    token_ids: list[int]
    arrival: float
    group: str


def _interleave(queues: Iterable[deque[_Waiting]], limit: int) -> list[_Waiting]:
    """Up to ``limit`` waiting inputs, taken round-robin from ``queues`` (the first of
    each queue, then the second of each ...), so that no queue fills them alone."""
    out: list[_Waiting] = []
    iterators = [iter(queue) for queue in islice(queues, limit)]
    while iterators and len(out) < limit:
        alive = []
        for iterator in iterators:
            item = next(iterator, None)
            if item is not None:
                out.append(item)
                alive.append(iterator)
                if len(out) == limit:
                    break
        iterators = alive
    return out


class PoolingCore:
    """Continuous batching of embedding requests over one model (see the module doc).

    Args:
        model: a transformers base model (``AutoModel``) returning ``last_hidden_state``.
        spec: how its hidden states are pooled.
        config: the engine configuration (``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``).
        model_dir: where the model came from (reported to the server).

    Raises:
        EngineConfigError: ``max_model_len`` longer than the model takes.
    """

    def __init__(
        self, model: torch.nn.Module, spec: PoolingSpec, config: EngineConfig, model_dir: str
    ) -> None:
        self.model = model
        self.spec = spec
        self.config = config
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
        self.embedding_dim = int(mconf.hidden_size)
        #: Waiting inputs by group (a request without a group is one of its own), in
        #: turn order: the next step's leader first (see `_take_batch`).
        self.groups: dict[str, deque[_Waiting]] = {}
        self._group_of: dict[str, str] = {}  # request id -> its group
        self._num_waiting = 0
        self._last_leader: str | None = None
        #: Called by the engine loop's protocol (a generator's grammar compiles); unused.
        self.on_grammar_event: Any = None
        self._last_batch = (0, 0)
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
        from transformers import AutoModel

        from trio_llm.dtype_choice import resolve_dtype
        from trio_llm.model_loader import resolve_model_dir

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.model.quantization is not None:
            raise EngineConfigError("--quantization applies to generating models only")
        model_dir = resolve_model_dir(config.model.model, config.cache_dir())
        spec = PoolingSpec.from_folder(model_dir)
        # float32 unless asked otherwise: the vectors are compared with the reference's.
        dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
        dtype = resolve_dtype(dtype, config.model.device)
        logger.info(f"loading {model_dir} ({dtype}, {config.model.device}) for embeddings")
        model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        model.to(config.model.device)
        model.eval()
        model.requires_grad_(False)
        return cls(model, spec, config, str(model_dir))

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
            task="embed",
            embedding_dim=self.embedding_dim,
        )

    # ------------------------------------------------------------ requests

    def add_request(self, message: AddRequest) -> RequestOutput | None:
        """Queue a request; returns a finished-with-error output if it is rejected
        (empty, or longer than ``max_model_len``)."""
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
        if error is not None:
            return RequestOutput(message.request_id, [], finish_reason="abort", error=error)
        group = message.group if message.group is not None else message.request_id
        waiting = _Waiting(message.request_id, ids, time.monotonic(), group)
        self.groups.setdefault(group, deque()).append(waiting)
        self._group_of[message.request_id] = group
        self._num_waiting += 1
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests if they still wait (unknown ids are ignored)."""
        gone: dict[str, set[str]] = {}
        for request_id in request_ids:
            group = self._group_of.pop(request_id, None)
            if group is not None:
                gone.setdefault(group, set()).add(request_id)
        for group, ids in gone.items():
            self._remove(group, lambda r, ids=ids: r.request_id in ids)

    def _remove(self, group: str, drop: Callable[[_Waiting], bool]) -> None:
        """Drop the inputs of ``group`` for which ``drop`` is true (and the group once
        it has none left)."""
        queue = self.groups[group]
        kept = deque(r for r in queue if not drop(r))
        self._num_waiting -= len(queue) - len(kept)
        if kept:
            self.groups[group] = kept
        else:
            del self.groups[group]
            if group == self._last_leader:
                self._last_leader = None

    def pause(self, request_ids: list[str]) -> None:
        """Nothing to pause: a request's one output comes with its step."""

    def resume(self, request_ids: list[str]) -> None:
        """Nothing to resume (see `pause`)."""

    def has_unfinished_requests(self) -> bool:
        """True while any request waits."""
        return bool(self._num_waiting)

    def has_work(self) -> bool:
        """True while any request waits."""
        return bool(self._num_waiting)

    def close(self) -> None:
        """Nothing to release."""

    # ------------------------------------------------------------ the step

    def _take_batch(self) -> list[_Waiting]:
        """The next batch, within ``max_num_seqs`` requests and ``max_num_batched_tokens``
        padded tokens (each row is padded to the longest, so similar lengths waste the
        least):

        1. The leader is the first group in turn order, after the previous step's leader
           went behind every group waiting now. Its oldest input always goes, then its
           inputs closest in length to that one (among its oldest `BATCH_WINDOW` times
           ``max_num_seqs``) while they fit.
        2. The room left goes to the other groups' inputs closest in length to the
           leader's oldest, among as many of theirs taken round-robin from the groups in
           turn order (so the first group cannot fill it alone), none longer than
           `FILL_LENGTH_FACTOR` times the leader's longest.

        Each group leads once per round, so a group waits for at most one step per group
        ahead of it, and every input is taken in the end."""
        if not self.groups:
            return []
        last = self._last_leader
        if last is not None and len(self.groups) > 1:
            self.groups[last] = self.groups.pop(last)  # behind everyone waiting now
        scheduler = self.config.scheduler
        max_rows, budget = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        window = BATCH_WINDOW * max_rows
        leader, queue = next(iter(self.groups.items()))
        self._last_leader = leader
        own = list(islice(queue, window))
        mine = len(own[0].token_ids)
        batch = [own[0]]
        longest = mine

        def fill(candidates: list[_Waiting], cap: int) -> None:
            nonlocal longest
            candidates.sort(key=lambda r: (abs(len(r.token_ids) - mine), len(r.token_ids)))
            for request in candidates:
                if len(batch) == max_rows or longest * (len(batch) + 1) > budget:
                    return  # nothing more can fit
                grown = max(longest, len(request.token_ids))
                if grown <= cap and grown * (len(batch) + 1) <= budget:
                    batch.append(request)
                    longest = grown

        fill(own[1:], budget)
        others = islice(self.groups.values(), 1, None)
        fill(_interleave(others, window), FILL_LENGTH_FACTOR * longest)
        taken: dict[str, set[int]] = {}
        for request in batch:
            taken.setdefault(request.group, set()).add(id(request))
            del self._group_of[request.request_id]
        for group, ids in taken.items():
            self._remove(group, lambda r, ids=ids: id(r) in ids)
        return batch

    def step(self) -> StepOutputs:
        """Embed one batch of waiting requests; each finishes with its vector."""
        start = time.perf_counter()
        batch = self._take_batch()
        outputs = []
        if batch:
            now = time.monotonic()
            vectors = self.embed([r.token_ids for r in batch])
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
    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        """The vectors of ``prompts`` (token ids), run as one right-padded batch.

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
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return pool(hidden, mask, self.spec).cpu()

    def stats(self, step_seconds: float = 0.0) -> StepStats:
        """Queue state now, with the counts of the batch a step just ran."""
        num_reqs, num_tokens = self._last_batch if step_seconds else (0, 0)
        return StepStats(
            num_running=0,
            num_waiting=self._num_waiting,
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
