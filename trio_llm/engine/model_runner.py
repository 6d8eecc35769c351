"""Turns a scheduled batch into one forward pass of the transformers model.

All scheduled tokens of all requests are packed into a single sequence (batch size 1,
no padding): single-token requests (decode) first, then prefill chunks. Positions are
given explicitly; keys and values go to the paged cache through `paged_attention`.
Logits are computed only at the last packed token of each request whose sequence is then
fully computed (the ones that sample a token this step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trio_llm.engine.attention import KVCache, PagedAttentionMetadata, PrefillSpan
from trio_llm.engine.block_manager import cdiv, slot_of
from trio_llm.engine.request import Request
from trio_llm.engine.scheduler import ScheduledBatch
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError

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
        slots: KV cache slots of the decode tokens.
        chunk_slots: int64 KV cache slots of each prefill chunk's new tokens.
        sample_rows: packed rows whose logits are sampled, one per ``sample_requests``.
        sample_requests: the requests that sample a token this step.
        prompt_rows: ``(request, first_target, row, count)`` for prompt logprobs.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    chunk_slots: list[torch.Tensor] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)

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
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self._workspace: dict[str, torch.Tensor] = {}
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            raise EngineConfigError(
                f"{describe(model.config)} is not supported: its output projection is not "
                "a Linear without bias"
            )
        # [vocab, hidden]; tied to the input embeddings for SmolLM2.
        self.lm_head_weight = head.weight
        #: Where the model lives; the step's index tensors are built on the CPU, then moved.
        self.device = head.weight.device
        self.dtype = head.weight.dtype

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one forward pass over the batch.

        Returns:
            The requests that sample this step with their next-token logits, and the
            hidden states of prompt positions whose logprobs were asked for.
        """
        decodes = [request for request, n in batch.requests if n == 1]
        chunks = [(request, n) for request, n in batch.requests if n > 1]
        step = _StepInputs()
        decode_blocks, decode_mask = self.prepare_decode(decodes, step)
        spans = self.prepare_prefill(chunks, step)
        slot_mapping = torch.cat([torch.tensor(step.slots, dtype=torch.long), *step.chunk_slots])
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping.to(self.device),
            num_decode=len(decodes),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            prefills=spans,
            workspace=self._workspace,
        )
        hidden = self.decoder(
            input_ids=torch.tensor([step.input_ids]).to(self.device),
            position_ids=torch.tensor([step.positions]).to(self.device),
            use_cache=False,
            paged=metadata,
        ).last_hidden_state[0]
        prompt_hidden = [
            PromptHidden(request, first, hidden[row : row + count].clone())
            for request, first, row, count in step.prompt_rows
        ]
        if not step.sample_rows:
            empty = hidden.new_empty(0, self.lm_head_weight.shape[0], dtype=torch.float32)
            return ModelOutput([], empty, prompt_hidden)
        logits = self.compute_logits(hidden[torch.tensor(step.sample_rows).to(self.device)])
        return ModelOutput(step.sample_requests, logits, prompt_hidden)

    def prepare_decode(
        self, decodes: list[Request], step: _StepInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pack one token of each single-token request into ``step`` (their slots go to
        ``step.slots``).

        Returns:
            ``(decode_blocks, decode_mask)`` of `PagedAttentionMetadata` on the model's
            device: int64 ``[len(decodes) * max_blocks]`` block tables padded with block
            0, and the ``[len(decodes), 1, 1, max_blocks * block_size]`` additive mask
            hiding the padding; both None when ``decodes`` is empty.
        """
        bs = self.block_size
        for request in decodes:
            pos = request.num_computed_tokens
            if request.wants_prompt_logprobs and request.next_prompt_logprob == pos + 1:
                step.prompt_rows.append((request, pos + 1, len(step.input_ids), 1))  # 1-token chunk
            step.input_ids.append(request.token_ids[pos])
            step.positions.append(pos)
            step.slots.append(slot_of(request.block_table, pos, bs))
            if pos + 1 == request.num_tokens:
                step.sample(request)
        if not decodes:
            return None, None
        max_blocks = max(cdiv(r.num_computed_tokens + 1, bs) for r in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for row, request in enumerate(decodes):
            blocks = request.block_table[:max_blocks]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        lengths = torch.tensor([r.num_computed_tokens + 1 for r in decodes])
        key_pos = torch.arange(max_blocks * bs)
        mask = torch.zeros(len(decodes), 1, 1, max_blocks * bs, dtype=self.dtype)
        mask.masked_fill_((key_pos[None, :] >= lengths[:, None])[:, None, None], -torch.inf)
        return table.view(-1).to(self.device), mask.to(self.device)

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
            table = torch.tensor(request.block_table, dtype=torch.long)
            context = torch.arange(end)
            context_slots = table[context // bs] * bs + context % bs
            step.chunk_slots.append(context_slots[start:])
            spans.append(
                PrefillSpan(
                    start=len(step.input_ids),
                    num_new=num_new,
                    context_len=end,
                    slots=context_slots.to(self.device) if start > 0 else None,
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

        On the model's device; the sampler moves them to the CPU where it needs to.
        """
        # logits^T = W @ h^T: with torch's BLAS this orientation runs about twice as fast
        # as h @ W^T for a few rows against the 49k-row vocabulary matrix.
        return torch.mm(self.lm_head_weight, hidden.t()).t().contiguous().float()
