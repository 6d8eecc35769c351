"""The model's output projection: final hidden states to float32 logits.

Logits are computed through the model's own head (`OwnHead`: its forward pass with the
decoder replaced by the selected hidden states), so that its final processing — logit
scaling, softcapping, an output bias — is the model's own. Where that head is a plain
bias-free projection, checked at start-up (`plain_head_weight`), a faster product with the
projection's weight gives the same logits; quantized runs multiply a quantized copy of it
(`quantized_head`).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from trio_llm.engine.gguf_linear import GGUFWeights
from trio_llm.engine.quantization import QuantizedLinear, can_quantize
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError

logger = logging.getLogger(__name__)

#: Configuration fields of final logit processing some families apply in their forward pass.
FINAL_PROCESSING_FIELDS = ("logits_scaling", "logit_scale", "final_logit_softcapping")


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


class OwnHead:
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


def plain_head_weight(model: torch.nn.Module, own: OwnHead) -> torch.Tensor | None:
    """The output projection's weight ``[vocab, hidden]`` when ``hidden @ weight.T`` gives
    the model's own logits (a plain bias-free projection, `OwnHead.agrees_with`); tied to
    the input embeddings for SmolLM2. None: the model's own head path serves every step."""
    head = model.get_output_embeddings()
    if _is_plain_projection(model, head) and own.agrees_with(head.weight):
        return head.weight
    return None


#: The rows of a GGUF file's output projection compared with the model's at start-up.
HEAD_ROWS_CHECKED = 2048


def quantized_head(
    quantization: str | None,
    gguf: GGUFWeights | None,
    weight: torch.Tensor | None,
    dtype: torch.dtype,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The output projection that quantized runs multiply, or None (float logits).

    Args:
        quantization: ``int8``, ``int4``, ``gguf`` or None.
        gguf: the GGUF file's blocks, for ``gguf``.
        weight: the plain projection's weight (`plain_head_weight`), or None.
        dtype: the model's dtype.

    Returns:
        A function of final hidden states ``[rows, hidden]`` to logits ``[rows, vocab]``:
        with ``gguf`` the file's own head where it equals ``weight``; with ``int8`` or
        ``int4`` a `QuantizedLinear` int8 copy of ``weight``; else None.
    """
    if gguf is not None:
        head = gguf.head
        # The file's head equals the model's where its first rows do (all of them would
        # take 0.4 s of start-up for SmolLM2's 49,152; layer 0 is checked whole).
        if (
            head is not None
            and weight is not None
            and (head.out_features, head.in_features) == tuple(weight.shape)
            and torch.equal(
                head.dequantized(HEAD_ROWS_CHECKED).to(dtype), weight[:HEAD_ROWS_CHECKED]
            )
        ):
            return functools.partial(head.packed().forward, out_dtype=torch.float32)
        logger.info("--quantization gguf: the output projection stays in float")
        return None
    if quantization is None or weight is None:
        return None
    # The output projection stays at int8 in both modes: with int4 there, perplexity rose
    # 7 % and greedy outputs left float32's after 2.5 tokens (median); with int8, 0.3 %
    # and 19.5 tokens (bench/quantization.py).
    if can_quantize(weight, "int8"):
        return QuantizedLinear.from_weight(weight, None, "int8")
    return None
