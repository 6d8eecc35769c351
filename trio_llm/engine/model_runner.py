"""Turns a scheduled batch into one forward pass of the transformers model.

All scheduled tokens of all requests are packed into a single sequence of batch size 1
(`trio_llm.engine.step_inputs`): single-token requests (decode) first, then prefill
chunks. Positions are given explicitly; keys and values go to the paged cache through
`paged_attention`. The packed sequence itself has no padding; on a GPU two paths pad: the
prefill chunks of a step are attended in one padded call (`PrefillBatch`), and a
decode-only batch replayed from a CUDA graph is padded to the graph's batch size and
block-table width (`trio_llm.engine.cuda_graphs`). Logits are computed only at the last
packed token of each request whose sequence is then fully computed (the ones that sample
a token this step), through the model's own head or an equal, faster product
(`trio_llm.engine.output_head`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trio_llm.config import EngineConfig, LoRAConfig
from trio_llm.engine.attention import ATTENTION_NAME, use_native_attention
from trio_llm.engine.attention_metadata import (
    PagedAttentionMetadata,
    step_metadata,
)
from trio_llm.engine.cuda_graphs import DecodeGraphs
from trio_llm.engine.gguf_linear import gguf_problem, read_gguf_weights
from trio_llm.engine.kv_cache import KVCache
from trio_llm.engine.lora import PER_MODULE, LoraAdapters, hook_modules, lora_step
from trio_llm.engine.native import native_decoder, native_unsupported
from trio_llm.engine.output_head import OwnHead, plain_head_weight, quantized_head
from trio_llm.engine.quantization import quantize_linears
from trio_llm.engine.request import Request
from trio_llm.engine.scheduled_batch import ScheduledBatch
from trio_llm.engine.step_inputs import StepBuilder, StepInputs
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError, ModelNotFoundError
from trio_llm.model_files.dtype_choice import explain_quantization
from trio_llm.model_files.loader import gguf_file_of, load_model

logger = logging.getLogger(__name__)

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
            kernels cannot run (or cannot read the cache's dtype: float16); or ``gguf``
            cannot serve this model (no GGUF file, not a Llama file, a tensor type
            without a kernel, no native kernels, or the file's weights differ from the
            model's).
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
        self.num_groups = len(kv_cache.groups.layers)
        parameter = next(model.parameters())
        #: Where the model lives; the step's inputs are staged on the CPU, then moved.
        self.device = parameter.device
        self.dtype = parameter.dtype
        self._steps = StepBuilder(kv_cache, self.device, self.dtype)
        #: Attend all prefill chunks of a step in one padded call (`PrefillBatch`) instead
        #: of one call per chunk: on a GPU, where a call costs a launch per layer and the
        #: padding is cheap. On the CPU the per-chunk calls (no padding) are kept.
        self.batched_prefill = self.device.type == "cuda"
        try:
            #: Decodes attend through the native kernel (`PagedAttentionMetadata`).
            self.native_attention = use_native_attention(
                attention_backend, self.device, kv_cache.keys[0].dtype
            )
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        self._head = OwnHead(model)
        #: ``[vocab, hidden]`` weight of a plain output projection, or None: the model's
        #: own head path serves every step.
        self.lm_head_weight = plain_head_weight(model, self._head)
        gguf = None
        if quantization == "gguf":
            gguf = read_gguf_weights(model, gguf_file, self.device)
        try:
            #: The engine's own forward pass (`trio_llm.engine.native`), or None.
            self.native = native_decoder(model, model_impl, quantization, gguf)
        except ValueError as exc:
            raise EngineConfigError(f"{describe(model.config)}: {exc}") from exc
        if gguf is None and quantization is not None and self.native is None:
            quantize_linears(self.decoder, quantization)
        #: The output projection as a `QuantizedLinear` (quantized runs with a plain head)
        #: or the GGUF file's own head: float32 ``[rows, vocab]`` logits of hidden states.
        self.quantized_head: Callable[[torch.Tensor], torch.Tensor] | None = quantized_head(
            quantization, gguf, self.lm_head_weight, self.dtype
        )
        #: Decode batches replayed from CUDA graphs, or None (eager steps).
        self.graphs = self._decode_graphs(max_num_seqs) if cuda_graphs else None
        #: The loaded LoRA adapters (`enable_lora`), or None: adapters are off.
        self.lora: LoraAdapters | None = None

    def enable_lora(self, config: LoRAConfig, model_dir: str) -> LoraAdapters:
        """Apply each step's LoRA adapters to the decoder's projections from now on
        (`trio_llm.engine.lora`); returns the engine's adapter set.

        Raises:
            EngineConfigError: the decoder has no ``layers`` to adapt.
        """
        if self.native is not None:
            layout = self.native.wrap_lora()
        else:
            layers = getattr(self.decoder, "layers", None)
            if layers is None:
                raise EngineConfigError(
                    f"--enable-lora: {describe(self.model.config)} has no decoder layers to adapt"
                )
            missing = hook_modules(layers)
            layout = {m: c for m, c in PER_MODULE.items() if m not in missing}
        self.lora = LoraAdapters(config, model_dir, layout, self.dtype, self.device)
        return self.lora

    def _decode_graphs(self, max_num_seqs: int) -> DecodeGraphs | None:
        """The CUDA graphs of decode batches on a GPU where the model qualifies, else None
        (logged)."""
        if self.device.type != "cuda":
            return None
        reason = DecodeGraphs.unsupported(self)
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return None
        return DecodeGraphs(self, max_num_seqs=max_num_seqs, capture=True)

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
        lora = None
        if self.lora is not None:
            lora = self.lora.batch(step.scheduled, _adapter_of)
        if lora is None and self.graphs is not None and self.graphs.takes(step):
            hidden = self.graphs.run(step)
        else:
            with lora_step(lora):
                hidden = self.forward(step.input_ids[None], step.positions[None], step.attention)
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
        """The `StepInputs` of ``batch`` (`trio_llm.engine.step_inputs.StepBuilder`), with
        this runner's `batched_prefill` and `native_attention` choices."""
        return self._steps.build(batch, self.batched_prefill, self.native_attention)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final hidden states ``[rows, hidden_size]``.

        On the model's device; the sampler moves them to the CPU where it needs to. The
        model's own final processing is applied (`trio_llm.engine.output_head`).
        """
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self.lm_head_weight is None:
            return self._head(hidden)
        # logits^T = W @ h^T: with torch's BLAS this orientation runs 1.3-1.7x as fast as
        # h @ W^T for 4-32 rows against the 49k-row vocabulary matrix.
        return torch.mm(self.lm_head_weight, hidden.t()).t().contiguous().float()


def _adapter_of(request: Request) -> object | None:
    return request.adapter


def load_quantized(model_dir: Path, config: EngineConfig) -> tuple[torch.nn.Module, EngineConfig]:
    """Load ``config``'s model from ``model_dir`` with ``--quantization`` decided
    (`trio_llm.model_files.dtype_choice.explain_quantization`, logged when not given): a GGUF
    file is served from its own blocks where the engine can (the native forward pass included),
    else de-quantized (``none``). On the GGUF path ``--dtype auto`` loads float32: the
    products multiply the blocks whatever the dtype, and float32 activations are the
    closer to the de-quantized float32 model (docs/benchmarks.md, issue 42).

    Returns:
        The model (eval mode) and ``config`` with ``quantization`` set (never None).

    Raises:
        As `trio_llm.model_files.loader.load_model`.
    """
    model_config = config.model
    asked = model_config.quantization
    gguf = gguf_file(config) if asked is None else None

    def problem(path: Path) -> str | None:
        if model_config.model_impl == "transformers":
            return "--model-impl transformers"
        return gguf_problem(path)

    method, why = explain_quantization(
        asked, model_config.dtype, model_config.device, gguf, problem
    )
    dtype = model_config.dtype
    if asked is None and method == "gguf" and dtype == "auto":
        dtype, why = "float32", f"{why}; --dtype auto: float32 activations on the GGUF path"
    model = load_model(model_dir, dtype, ATTENTION_NAME, model_config.device)
    reason = native_unsupported(model) if asked is None and method == "gguf" else None
    if reason is not None:
        method, why = None, f"--quantization auto: none ({reason})"
        if dtype != model_config.dtype:
            model = load_model(model_dir, model_config.dtype, ATTENTION_NAME, model_config.device)
    if asked is None:
        logger.info(why)
    quantized = dataclasses.replace(model_config, quantization=method or "none")
    return model, dataclasses.replace(config, model=quantized)


def gguf_file(config: EngineConfig) -> Path | None:
    """The GGUF file ``config.model`` names (a named GGUF model or a ``.gguf`` path), or
    None (a Hugging Face folder; ``--quantization gguf`` refuses it)."""
    try:
        return gguf_file_of(config.model.model, config.cache_dir())
    except ModelNotFoundError:
        return None
