"""How an embedding model's hidden states become one vector per input.

How a vector is made follows the model folder:

- a sentence-transformers folder (``modules.json``): the Transformer module (the folder
  itself), then its ``Pooling`` module (``1_Pooling/config.json``: CLS, mean, max,
  mean-sqrt-len or last token) and, if listed, ``Normalize`` (unit L2 norm). Other
  modules (``Dense`` projections, for one) are refused at start-up, since leaving them out
  would give other vectors than sentence-transformers does. ``max_seq_length`` of
  ``sentence_bert_config.json`` is the context length.
- any other folder (``--runner pooling`` on a language model): the base model's last
  hidden state at the last token, L2-normalized (vLLM's default for decoders).

A cross-encoder (`trio_llm.model_files.loader.is_cross_encoder`: a
``...ForSequenceClassification`` model, as sentence-transformers' ``CrossEncoder`` loads
it) is not pooled: its one logit per (query, document) pair goes through the activation
``CrossEncoder.predict`` applies (`cross_encoder_activation`), and that is the pair's
score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trio_llm.errors import EngineConfigError

#: sentence-transformers pooling modes this core implements (``pooling_mode_<name>``).
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")


def is_sentence_transformers(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a sentence-transformers folder (it has ``modules.json``)."""
    return (Path(model_dir) / "modules.json").is_file()


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


#: The activations a cross-encoder's folder may name (sentence-transformers' dotted paths),
#: and what this core applies for them.
CROSS_ENCODER_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
}


def cross_encoder_activation(model_dir: Path, num_labels: int) -> str:
    """``sigmoid`` or ``identity``: what sentence-transformers' ``CrossEncoder.predict``
    applies to this folder's logits (``activation_fn`` of ``config_sentence_transformers.json``,
    else of ``config.json``'s ``sentence_transformers``, else its older
    ``sbert_ce_default_activation_function``; none named: sigmoid for one label).

    Raises:
        EngineConfigError: not one label (a reranker scores with one), or an activation
            outside `CROSS_ENCODER_ACTIVATIONS`.
    """
    model_dir = Path(model_dir)
    if num_labels != 1:
        raise EngineConfigError(
            f"{model_dir} is a sequence-classification model with {num_labels} labels; "
            "trio-llm serves cross-encoders (rerankers) of one label"
        )
    names: list[Any] = []
    st_config = model_dir / "config_sentence_transformers.json"
    if st_config.is_file():
        names.append(json.loads(st_config.read_text()).get("activation_fn"))
    config = json.loads((model_dir / "config.json").read_text())
    names.append((config.get("sentence_transformers") or {}).get("activation_fn"))
    names.append(config.get("sbert_ce_default_activation_function"))
    name = next((n for n in names if n), None)
    if name is None:
        return "sigmoid"
    if name not in CROSS_ENCODER_ACTIVATIONS:
        raise EngineConfigError(
            f"the cross-encoder activation {name!r} is not supported; trio-llm applies "
            f"{sorted(set(CROSS_ENCODER_ACTIVATIONS))}"
        )
    return CROSS_ENCODER_ACTIVATIONS[name]
