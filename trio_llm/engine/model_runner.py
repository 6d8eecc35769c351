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
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from trio_llm.engine.attention import (
    KVCache,
    PagedAttentionMetadata,
    PrefillSpan,
    step_metadata,
)
from trio_llm.engine.block_manager import cdiv, slot_of
from trio_llm.engine.native import native_decoder
from trio_llm.engine.quantization import QuantizedLinear, can_quantize, quantize_linears
from trio_llm.engine.request import Request
from trio_llm.engine.scheduler import ScheduledBatch
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError

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
class _StepInputs:
    """The packed input of one step, filled by `ModelRunner.prepare_decode` and then
    `ModelRunner.prepare_prefill` (on the CPU).

    Attributes:
        input_ids: token ids, packed (decodes first, then prefill chunks).
        positions: the position of each packed token in its request.
        slots: per KV cache group, the cache slots of the decode tokens.
        chunk_slots: per KV cache group, int64 cache slots of each prefill chunk's new
            tokens.
        sample_rows: packed rows whose logits are sampled, one per ``sample_requests``.
        sample_requests: the requests that sample a token this step.
        prompt_rows: ``(request, first_target, row, count)`` for prompt logprobs.
        decode_lens: each decode request's context length in tokens (its new one
            included), as the decode lengths tensor holds them.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)
    chunk_slots: list[list[torch.Tensor]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)

    def sample(self, request: Request) -> None:
        """The last packed token is ``request``'s last: its logits are sampled."""
        self.sample_rows.append(len(self.input_ids) - 1)
        self.sample_requests.append(request)


class ModelRunner:
    """Runs a causal LM loaded with ``attn_implementation=ATTENTION_NAME`` over a `KVCache`.

    Args:
        model: a transformers causal LM (e.g. ``LlamaForCausalLM``), on the CPU or on a
            CUDA device (the step's inputs are built on the CPU and moved to its device).
        kv_cache: the paged cache this runner writes to.
        model_impl: ``auto``, ``trio_llm`` or ``transformers`` (`trio_llm.engine.native`).
        quantization: ``int8``, ``int4`` or None: the decoder's linear layers become
            `QuantizedLinear` layers of that mode (their float weights are dropped), and a
            plain output projection an int8 one.

    Raises:
        EngineConfigError: ``model_impl`` is ``trio_llm`` and the model has no native
            implementation.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        model_impl: str = "auto",
        quantization: str | None = None,
    ) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.num_groups = len(kv_cache.groups.layers)
        self._workspace: dict[str, torch.Tensor] = {}
        parameter = next(model.parameters())
        #: Where the model lives; the step's index tensors are built on the CPU, then moved.
        self.device = parameter.device
        self.dtype = parameter.dtype
        self._head = _OwnHead(model)
        head = model.get_output_embeddings()
        # [vocab, hidden]; tied to the input embeddings for SmolLM2. None: use the model's
        # own head path for every step.
        self.lm_head_weight: torch.Tensor | None = None
        if _is_plain_projection(model, head) and self._head.agrees_with(head.weight):
            self.lm_head_weight = head.weight
        try:
            #: The engine's own forward pass (`trio_llm.engine.native`), or None.
            self.native = native_decoder(model, model_impl, quantization)
        except ValueError as exc:
            raise EngineConfigError(f"{describe(model.config)}: {exc}") from exc
        #: The output projection as a `QuantizedLinear` (quantized runs with a plain head).
        self.quantized_head: QuantizedLinear | None = None
        if quantization is not None:
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

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (rows of the output projection)."""
        return self._head.vocab_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one forward pass over the batch.

        Returns:
            The requests that sample this step with their next-token logits, and the
            hidden states of prompt positions whose logprobs were asked for.
        """
        decodes = [request for request, n in batch.requests if n == 1]
        chunks = [(request, n) for request, n in batch.requests if n > 1]
        groups = range(self.num_groups)
        step = _StepInputs(slots=[[] for _ in groups], chunk_slots=[[] for _ in groups])
        decode_blocks, decode_lengths = self.prepare_decode(decodes, step)
        spans = self.prepare_prefill(chunks, step)
        slot_mapping = [
            torch.cat([torch.tensor(step.slots[g], dtype=torch.long), *step.chunk_slots[g]]).to(
                self.device
            )
            for g in groups
        ]
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            num_decode=len(decodes),
            decode_blocks=decode_blocks,
            decode_lengths=decode_lengths,
            prefills=spans,
            workspace=self._workspace,
            dtype=self.dtype,
            decode_context_lens=step.decode_lens,
        )
        input_ids = torch.tensor([step.input_ids]).to(self.device)
        position_ids = torch.tensor([step.positions]).to(self.device)
        with step_metadata(metadata):
            if self.native is not None:
                hidden = self.native(input_ids, position_ids)
            else:
                hidden = self.decoder(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False
                ).last_hidden_state[0]
        prompt_hidden = [
            PromptHidden(request, first, hidden[row : row + count].clone())
            for request, first, row, count in step.prompt_rows
        ]
        if not step.sample_rows:
            empty = hidden.new_empty(0, self._head.vocab_size, dtype=torch.float32)
            return ModelOutput([], empty, prompt_hidden)
        logits = self.compute_logits(hidden[torch.tensor(step.sample_rows).to(self.device)])
        return ModelOutput(step.sample_requests, logits, prompt_hidden)

    def prepare_decode(
        self, decodes: list[Request], step: _StepInputs
    ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
        """Pack one token of each single-token request into ``step`` (their slots go to
        ``step.slots``).

        Returns:
            ``(decode_blocks, decode_lengths)`` of `PagedAttentionMetadata` on the model's
            device: per KV cache group, int64 ``[len(decodes), max_blocks]`` block tables
            padded with block 0 (block 0 also where a group holds no block), and int64
            ``[len(decodes)]`` context lengths; both None when ``decodes`` is empty.
        """
        bs = self.block_size
        for request in decodes:
            pos = request.num_computed_tokens
            if request.wants_prompt_logprobs and request.next_prompt_logprob == pos + 1:
                step.prompt_rows.append((request, pos + 1, len(step.input_ids), 1))  # 1-token chunk
            step.input_ids.append(request.token_ids[pos])
            step.positions.append(pos)
            for group, table in enumerate(request.block_tables):
                step.slots[group].append(slot_of(table, pos, bs))
            if pos + 1 == request.num_tokens:
                step.sample(request)
        if not decodes:
            return None, None
        max_blocks = max(cdiv(r.num_computed_tokens + 1, bs) for r in decodes)
        tables = torch.zeros(self.num_groups, len(decodes), max_blocks, dtype=torch.long)
        for row, request in enumerate(decodes):
            for group, table in enumerate(request.block_tables):
                blocks = table[:max_blocks]
                tables[group, row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        tables.clamp_(min=0)  # NO_BLOCK: behind a window, never read unmasked
        step.decode_lens = [r.num_computed_tokens + 1 for r in decodes]
        lengths = torch.tensor(step.decode_lens)
        return list(tables.to(self.device).unbind(0)), lengths.to(self.device)

    def prepare_prefill(
        self, chunks: list[tuple[Request, int]], step: _StepInputs
    ) -> list[PrefillSpan]:
        """Pack each ``(request, num_new)`` chunk of several tokens into ``step``, after
        the decodes (their slots go to ``step.chunk_slots``).

        Returns:
            One `PrefillSpan` per chunk, in packing order; a chunk that continues an
            earlier one carries the slots of its whole context (on the model's device).
        """
        bs = self.block_size
        spans = []
        for request, num_new in chunks:
            start = request.num_computed_tokens
            end = start + num_new
            if request.wants_prompt_logprobs:
                # Position p's hidden state predicts token p + 1.
                first = max(start + 1, request.next_prompt_logprob)
                last = min(end + 1, request.num_prompt_tokens)
                if first < last:
                    row = len(step.input_ids) + first - 1 - start
                    step.prompt_rows.append((request, first, row, last - first))
            context = torch.arange(end)
            span_slots = []
            for group, table in enumerate(request.block_tables):
                # NO_BLOCK (behind a window, never read) as block 0, not a negative slot.
                blocks = torch.tensor(table, dtype=torch.long).clamp_(min=0)
                context_slots = blocks[context // bs] * bs + context % bs
                step.chunk_slots[group].append(context_slots[start:])
                span_slots.append(context_slots.to(self.device))
            spans.append(
                PrefillSpan(
                    start=len(step.input_ids),
                    num_new=num_new,
                    context_len=end,
                    slots=span_slots if start > 0 else None,
                )
            )
            step.input_ids.extend(request.token_ids[start:end])
            step.positions.extend(range(start, end))
            if end == request.num_tokens:
                step.sample(request)
        return spans

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
