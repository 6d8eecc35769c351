"""Turns a scheduled batch into one forward pass of the transformers model.

All scheduled tokens of all requests are packed into a single sequence (batch size 1,
no padding): single-token requests (decode) first, then prefill chunks. Positions are
given explicitly; keys and values go to the paged cache through `paged_attention`.
Logits are computed only at the last packed token of each request whose sequence is then
fully computed (the ones that sample a token this step), through the model's own head
(its forward pass with the decoder replaced by the selected hidden states), so that its
final processing — logit scaling, softcapping, an output bias — is the model's own. Where
that head is a plain bias-free projection, checked at start-up, a faster product with the
projection's weight gives the same logits.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from trio_llm.engine.attention import use_native_attention
from trio_llm.engine.attention_metadata import (
    PagedAttentionMetadata,
    PrefillBatch,
    PrefillSpan,
    step_metadata,
)
from trio_llm.engine.block_manager import cdiv
from trio_llm.engine.cuda_graphs import DecodeGraphs
from trio_llm.engine.gguf_linear import GGUFWeights, kernel_available
from trio_llm.engine.kv_cache import KVCache, context_slots
from trio_llm.engine.native import native_decoder
from trio_llm.engine.quantization import QuantizedLinear, can_quantize, quantize_linears
from trio_llm.engine.request import Request
from trio_llm.engine.scheduler import ScheduledBatch
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError

logger = logging.getLogger(__name__)

#: Configuration fields of final logit processing some families apply in their forward pass.
FINAL_PROCESSING_FIELDS = ("logits_scaling", "logit_scale", "final_logit_softcapping")

#: Rows of prompt hidden states turned into logits at once for prompt logprobs: bounds the
#: temporary ``[rows, vocab]`` float32 matrix (256 x 49,152 x 4 bytes = 48 MiB).
PROMPT_LOGITS_ROWS = 256


@dataclass
class PromptHidden:
    """Hidden states of prompt positions whose logprobs a request asked for.

    Attributes:
        request: the request.
        first_target: the prompt position predicted by row 0 (row ``i`` predicts prompt
            token ``first_target + i`` from the positions before it).
        hidden: ``[rows, hidden_size]`` final hidden states (model dtype).
    """

    request: Request
    first_target: int
    hidden: torch.Tensor


@dataclass
class ModelOutput:
    """What one forward pass produced.

    Attributes:
        requests: the requests that sample a token this step.
        logits: float32 ``[len(requests), vocab_size]``, row ``i`` for ``requests[i]``, on
            the model's device.
        prompt_hidden: hidden states for prompt logprobs, one entry per request that
            computed such positions this step.
    """

    requests: list[Request]
    logits: torch.Tensor
    prompt_hidden: list[PromptHidden] = field(default_factory=list)


@dataclass
class StepInputs:
    """The packed input of one step, on the model's device.

    Built by `ModelRunner.prepare`: the scheduled requests are read once, in Python, into
    one int64 staging buffer (token ids, each request's first position and token count,
    the sampled rows, the padded block tables), copied to the device in one transfer
    (from pinned memory, without waiting, on a GPU); positions and cache slots are then
    derived there with tensor operations.

    Attributes:
        input_ids: int64 ``[T]`` token ids, packed (decodes first, then prefill chunks).
        positions: int64 ``[T]`` the position of each packed token in its request.
        slot_mapping: per KV cache group, int64 ``[T]`` the cache slot of each token.
        num_decode: the first ``num_decode`` requests (and packed tokens) have one token.
        decode_blocks: per KV cache group, int64 ``[num_decode, columns]`` block tables
            padded with block 0 (also where a group holds no block); None without decodes.
        decode_lengths: int64 ``[num_decode]`` context lengths (the new token included).
        decode_lens: ``decode_lengths`` as Python ints.
        prefills: one `PrefillSpan` per multi-token chunk, in packed order.
        prefill_batch: the chunks as one padded batch (`PrefillBatch`), when the runner
            attends them in one call; else None.
        sample_rows: int64 ``[S]`` packed rows whose logits are sampled.
        sample_requests: the ``S`` requests that sample a token this step.
        prompt_rows: ``(request, first_target, row, count)`` for prompt logprobs.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: list[torch.Tensor]
    num_decode: int
    decode_blocks: list[torch.Tensor] | None
    decode_lengths: torch.Tensor | None
    decode_lens: list[int]
    prefills: list[PrefillSpan]
    prefill_batch: PrefillBatch | None
    sample_rows: torch.Tensor
    sample_requests: list[Request]
    prompt_rows: list[tuple[Request, int, int, int]]


def _read_gguf(model: torch.nn.Module, gguf_file: Path | None, device: torch.device) -> GGUFWeights:
    """The GGUF file's blocks for ``--quantization gguf``, checked against ``model``.

    Raises:
        EngineConfigError: why this model or file cannot be served that way.
    """
    name = describe(model.config)
    if device.type != "cpu":
        raise EngineConfigError(f"{name}: --quantization gguf runs on the CPU only")
    if gguf_file is None:
        raise EngineConfigError(
            f"{name}: --quantization gguf needs a GGUF model (a .gguf file or a model "
            "shipped as one); this one was loaded from a Hugging Face folder"
        )
    reason = kernel_available()
    if reason is not None:
        raise EngineConfigError(f"{name}: --quantization gguf: {reason}")
    try:
        weights = GGUFWeights.read(gguf_file, model.config)
        weights.check_against(model)
    except ValueError as exc:
        raise EngineConfigError(f"{name}: --quantization gguf: {exc}") from exc
    logger.info("--quantization gguf: the decoder multiplies %s's own blocks", gguf_file.name)
    return weights


class ModelRunner:
    """Runs a causal LM loaded with ``attn_implementation=ATTENTION_NAME`` over a `KVCache`.

    Args:
        model: a transformers causal LM (e.g. ``LlamaForCausalLM``), on the CPU or on a
            CUDA device (each step's inputs are staged on the CPU and moved to its device
            in one copy, `StepInputs`).
        kv_cache: the paged cache this runner writes to.
        model_impl: ``auto``, ``trio_llm`` or ``transformers`` (`trio_llm.engine.native`).
        attention_backend: ``auto``, ``CPU_ATTN`` or ``TORCH_SDPA``: whether decodes attend
            through the native CPU kernel (`trio_llm.engine.attention.use_native_attention`,
            which loads the kernels and logs which path runs).
        quantization: ``int8``, ``int4`` or None: the decoder's linear layers become
            `QuantizedLinear` layers of that mode (their float weights are dropped), and a
            plain output projection an int8 one; ``gguf``: the decoder's projections and
            the output projection multiply ``gguf_file``'s own blocks
            (`trio_llm.engine.gguf_linear`; the native forward pass and the native
            kernels are required).
        gguf_file: the GGUF file ``model`` was converted from, for ``gguf``.
        cuda_graphs: on a GPU, replay decode-only batches from CUDA graphs
            (`trio_llm.engine.cuda_graphs`) where the model qualifies; False is vLLM's
            ``--enforce-eager``. Ignored on the CPU.
        max_num_seqs: the largest decode batch a graph is captured for.

    Raises:
        EngineConfigError: ``model_impl`` is ``trio_llm`` and the model has no native
            implementation; ``attention_backend`` is ``CPU_ATTN`` and the native
            kernels cannot run; or ``gguf`` cannot serve this model (no GGUF file, not a
            Llama file, a tensor type without a kernel, no native kernels, or the file's
            weights differ from the model's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        model_impl: str = "auto",
        attention_backend: str = "auto",
        quantization: str | None = None,
        cuda_graphs: bool = True,
        max_num_seqs: int = 256,
        gguf_file: Path | None = None,
    ) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.num_groups = len(kv_cache.groups.layers)
        self._workspace: dict[str, torch.Tensor] = {}
        parameter = next(model.parameters())
        #: Where the model lives; the step's inputs are staged on the CPU, then moved.
        self.device = parameter.device
        self.dtype = parameter.dtype
        self._pinned: torch.Tensor | None = None
        self._staged: torch.cuda.Event | None = None
        #: Attend all prefill chunks of a step in one padded call (`PrefillBatch`) instead
        #: of one call per chunk: on a GPU, where a call costs a launch per layer and the
        #: padding is cheap. On the CPU the per-chunk calls (no padding) are kept.
        self.batched_prefill = self.device.type == "cuda"
        #: Some layer softcaps its attention logits: it attends chunk by chunk even with
        #: a prefill batch.
        self._softcapped = any(spec.softcap is not None for spec in kv_cache.layers)
        try:
            #: Decodes attend through the native kernel (`PagedAttentionMetadata`).
            self.native_attention = use_native_attention(attention_backend, self.device)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        self._head = _OwnHead(model)
        head = model.get_output_embeddings()
        # [vocab, hidden]; tied to the input embeddings for SmolLM2. None: use the model's
        # own head path for every step.
        self.lm_head_weight: torch.Tensor | None = None
        if _is_plain_projection(model, head) and self._head.agrees_with(head.weight):
            self.lm_head_weight = head.weight
        gguf = None
        if quantization == "gguf":
            gguf = _read_gguf(model, gguf_file, self.device)
        try:
            #: The engine's own forward pass (`trio_llm.engine.native`), or None.
            self.native = native_decoder(model, model_impl, quantization, gguf)
        except ValueError as exc:
            raise EngineConfigError(f"{describe(model.config)}: {exc}") from exc
        #: The output projection as a `QuantizedLinear` (quantized runs with a plain head)
        #: or the GGUF file's own head: float32 ``[rows, vocab]`` logits of hidden states.
        self.quantized_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        if gguf is not None:
            head = gguf.head
            if (
                head is not None
                and self.lm_head_weight is not None
                and torch.equal(head.dequantized().to(self.dtype), self.lm_head_weight)
            ):
                self.quantized_head = functools.partial(head.forward, out_dtype=torch.float32)
            else:
                logger.info("--quantization gguf: the output projection stays in float")
        elif quantization is not None:
            if self.native is None:
                quantize_linears(self.decoder, quantization)
            # The output projection stays at int8 in both modes: with int4 there,
            # perplexity rose 7 % and greedy outputs left float32's after 2.5 tokens
            # (median); with int8, 0.3 % and 19.5 tokens (bench/quantization.py).
            head_method = "int8"
            if self.lm_head_weight is not None and can_quantize(self.lm_head_weight, head_method):
                self.quantized_head = QuantizedLinear.from_weight(
                    self.lm_head_weight, None, head_method
                )
        #: Decode batches replayed from CUDA graphs, or None (eager steps).
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            reason = DecodeGraphs.unsupported(self)
            if reason is None:
                self.graphs = DecodeGraphs(self, max_num_seqs=max_num_seqs, capture=True)
            else:
                logger.info("decode steps run eagerly: %s", reason)

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (rows of the output projection)."""
        return self._head.vocab_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one forward pass over the batch.

        A batch of decodes only runs through `graphs` when it has them (a captured CUDA
        graph of its padded size); any other batch runs the decoder eagerly.

        Returns:
            The requests that sample this step with their next-token logits, and the
            hidden states of prompt positions whose logprobs were asked for.
        """
        step = self.prepare(batch)
        if self.graphs is not None and self.graphs.takes(step):
            hidden = self.graphs.run(step)
        else:
            metadata = PagedAttentionMetadata(
                kv_cache=self.kv_cache,
                slot_mapping=step.slot_mapping,
                num_decode=step.num_decode,
                decode_blocks=step.decode_blocks,
                decode_lengths=step.decode_lengths,
                prefills=step.prefills,
                workspace=self._workspace,
                dtype=self.dtype,
                decode_context_lens=step.decode_lens,
                prefill_batch=step.prefill_batch,
                native_attention=self.native_attention,
            )
            hidden = self.forward(step.input_ids[None], step.positions[None], metadata)
        prompt_hidden = [
            PromptHidden(request, first, hidden[row : row + count].clone())
            for request, first, row, count in step.prompt_rows
        ]
        if not step.sample_requests:
            empty = hidden.new_empty(0, self._head.vocab_size, dtype=torch.float32)
            return ModelOutput([], empty, prompt_hidden)
        logits = self.compute_logits(hidden[step.sample_rows])
        return ModelOutput(step.sample_requests, logits, prompt_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over one packed step: int64 ``[1, T]`` ids and positions, with
        ``metadata`` for the attention; returns the final hidden states ``[T, hidden]``."""
        with step_metadata(metadata):
            if self.native is not None:
                return self.native(input_ids, position_ids)
            return self.decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False
            ).last_hidden_state[0]

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The `StepInputs` of ``batch``: single-token requests first, then the prefill
        chunks (see `StepInputs` for how they are built)."""
        decodes = [(request, 1) for request, n in batch.requests if n == 1]
        chunks = [(request, n) for request, n in batch.requests if n > 1]
        scheduled = decodes + chunks
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []
        for request, n in scheduled:
            start = request.num_computed_tokens
            end = start + n
            if request.wants_prompt_logprobs:
                # Position p's hidden state predicts token p + 1.
                first = max(start + 1, request.next_prompt_logprob)
                last = min(end + 1, request.num_prompt_tokens)
                if n == 1 and request.next_prompt_logprob == start + 1:
                    prompt_rows.append((request, start + 1, len(ids), 1))
                elif n > 1 and first < last:
                    prompt_rows.append((request, first, len(ids) + first - 1 - start, last - first))
            ids.extend(request.token_ids[start:end])
            starts.append(start)
            counts.append(n)
            if end == request.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_requests.append(request)
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        columns = cdiv(max(ends), bs)
        tables: list[int] = []
        for group in range(self.num_groups):
            for request, _ in scheduled:
                table = request.block_tables[group][:columns]
                tables.extend(table)
                tables.extend([0] * (columns - len(table)))
        num_tokens, num_requests, num_decode = len(ids), len(scheduled), len(decodes)
        staged = self._stage([*ids, *starts, *counts, *sample_rows, *tables])
        input_ids, rest = staged[:num_tokens], staged[num_tokens:]
        first_pos, n_new, rest = (
            rest[:num_requests],
            rest[num_requests : 2 * num_requests],
            rest[2 * num_requests :],
        )
        rows = rest[: len(sample_rows)]
        # NO_BLOCK (-1: behind a sliding window, never read unmasked) reads block 0.
        table_t = rest[len(sample_rows) :].view(self.num_groups, num_requests, columns).clamp(min=0)
        device = staged.device
        owner = torch.repeat_interleave(
            torch.arange(num_requests, device=device), n_new, output_size=num_tokens
        )
        first_row = torch.cumsum(n_new, 0) - n_new
        positions = first_pos[owner] + torch.arange(num_tokens, device=device) - first_row[owner]
        block_col, offset = positions // bs, positions % bs
        slot_mapping = [table_t[g, owner, block_col] * bs + offset for g in range(self.num_groups)]

        decode_blocks = decode_lengths = None
        decode_lens = [start + 1 for start in starts[:num_decode]]
        if num_decode:
            decode_columns = cdiv(max(decode_lens), bs)
            decode_blocks = list(table_t[:, :num_decode, :decode_columns].unbind(0))
            decode_lengths = first_pos[:num_decode] + 1
        prefill_batch = None
        if chunks and self.batched_prefill:
            prefill_batch = PrefillBatch.build(
                table_t[:, num_decode:],
                first_pos[num_decode:],
                n_new[num_decode:],
                first_row[num_decode:],
                max_new=max(n for _, n in chunks),
                max_context=max(ends[num_decode:]),
                block_size=bs,
                num_tokens=num_tokens,
            )
        spans = []
        row = num_decode
        # A chunk's context slots, for the layers that attend chunk by chunk (all of
        # them, or with a prefill batch those with a softcap).
        per_chunk = prefill_batch is None or self._softcapped
        for index in range(num_decode, num_requests):
            start, n = starts[index], counts[index]
            span_slots = None
            if start > 0 and per_chunk:
                span_slots = [
                    context_slots(table_t[g, index], start + n, bs) for g in range(self.num_groups)
                ]
            spans.append(PrefillSpan(start=row, num_new=n, context_len=start + n, slots=span_slots))
            row += n
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            num_decode=num_decode,
            decode_blocks=decode_blocks,
            decode_lengths=decode_lengths,
            decode_lens=decode_lens,
            prefills=spans,
            prefill_batch=prefill_batch,
            sample_rows=rows,
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
        )

    def _stage(self, values: list[int]) -> torch.Tensor:
        """``values`` as one int64 tensor on the model's device: on a GPU through a reused
        pinned buffer and one asynchronous copy (the buffer is rewritten only after the
        step's sampled ids were read back, so the copy has finished)."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        if self._pinned is None or self._pinned.numel() < host.numel():
            self._pinned = torch.empty(max(host.numel(), 1 << 16), dtype=torch.long).pin_memory()
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has left the buffer
        pinned = self._pinned[: host.numel()]
        pinned.copy_(host)
        staged = pinned.to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return staged

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final hidden states ``[rows, hidden_size]``.

        On the model's device; the sampler moves them to the CPU where it needs to. The
        model's own final processing is applied (see the module docstring).
        """
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self.lm_head_weight is None:
            return self._head(hidden)
        # logits^T = W @ h^T: with torch's BLAS this orientation runs 1.3-1.7x as fast as
        # h @ W^T for 4-32 rows against the 49k-row vocabulary matrix.
        return torch.mm(self.lm_head_weight, hidden.t()).t().contiguous().float()


class _HeadInput(BaseModelOutputWithPast):
    """The decoder output a model's head reads; any other field (router logits of a
    mixture of experts, ...) reads as None."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _GivenHiddenStates(torch.nn.Module):
    """Stands in for the decoder inside the model's forward: returns ``hidden``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.calls = 0

    def forward(self, *args: object, **kwargs: object) -> BaseModelOutputWithPast:
        self.calls += 1
        return _HeadInput(last_hidden_state=self.hidden)


class _OwnHead:
    """The model's own head path: its causal-LM forward with the decoder replaced by
    given final hidden states, so the logits get whatever the family applies after the
    output projection.

    Raises:
        EngineConfigError: the model's forward does not call its decoder exactly once or
            does not return logits of one row per hidden state.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._given = _GivenHiddenStates()
        prefix = getattr(model, "base_model_prefix", "")
        decoder = model.get_decoder()
        if not prefix or model._modules.get(prefix) is not decoder:
            raise EngineConfigError(
                f"{describe(model.config)} is not supported: its decoder is not its "
                f"base model attribute {prefix!r}"
            )
        # A shallow copy sharing every module but the decoder.
        self._shell = copy.copy(model)
        self._shell._modules = dict(model._modules)
        self._shell._modules[prefix] = self._given
        parameter = next(model.parameters())
        probe = torch.randn(3, model.config.hidden_size, dtype=parameter.dtype)
        try:
            logits = self(probe.to(parameter.device))
        except EngineConfigError:
            raise
        except Exception as exc:
            raise EngineConfigError(
                f"{describe(model.config)} is not supported: its logits cannot be computed "
                f"through its own head ({type(exc).__name__}: {exc})"
            ) from exc
        if logits.shape[0] != 3:
            raise EngineConfigError(
                f"{describe(model.config)} is not supported: its head returned "
                f"{tuple(logits.shape)} logits for 3 hidden states"
            )
        #: Width of the logits (the output projection's rows).
        self.vocab_size = logits.shape[1]

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final hidden states ``[rows, hidden_size]``."""
        self._given.hidden = hidden.unsqueeze(0)
        calls = self._given.calls
        try:
            dummy_ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self._shell(input_ids=dummy_ids, use_cache=False, logits_to_keep=0).logits
        finally:
            self._given.hidden = None
        if self._given.calls != calls + 1:
            raise EngineConfigError("the model's forward did not call its decoder exactly once")
        return logits[0].float()

    def agrees_with(self, weight: torch.Tensor) -> bool:
        """Whether ``hidden @ weight.T`` gives this head's logits (checked on random rows)."""
        probe = torch.randn(4, weight.shape[1], dtype=weight.dtype, device=weight.device)
        own = self(probe)
        fast = torch.mm(weight, probe.t()).t().float()
        # A few units in the last place of the dtype (bfloat16 rounds each logit to 8 bits).
        eps = max(1e-4, 4 * torch.finfo(weight.dtype).eps)
        tolerance = eps * float(own.abs().max()) + 1e-6
        return own.shape == fast.shape and bool((own - fast).abs().max() <= tolerance)


def _is_plain_projection(model: torch.nn.Module, head: torch.nn.Module | None) -> bool:
    """A bias-free Linear output projection and no known final logit processing."""
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    config = model.config
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in FINAL_PROCESSING_FIELDS)
