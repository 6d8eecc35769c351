"""What the engine derives from the model and its configuration (`ModelInfo`): its context
length, end-of-sequence ids, vocabulary, dtype and KV cache size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trio_llm.config import EngineConfig
from trio_llm.engine.support import check_context, check_supported
from trio_llm.errors import EngineConfigError


@dataclass(frozen=True)
class ModelInfo:
    """What the engine derived from the model and its configuration."""

    model_dir: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    dtype: str


def max_model_len_of(mconf: object, config: EngineConfig) -> int:
    """The context length the engine serves: ``--max-model-len`` or the model's
    ``max_position_embeddings``.

    Raises:
        EngineConfigError: an unsupported model (`check_supported`), a length past the
            model's positions, or a context the model cannot serve (`check_context`).
    """
    check_supported(mconf)
    max_model_len = config.model.max_model_len or mconf.max_position_embeddings
    if max_model_len > mconf.max_position_embeddings:
        raise EngineConfigError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"max_position_embeddings {mconf.max_position_embeddings}"
        )
    check_context(mconf, max_model_len)
    return max_model_len


def eos_token_ids_of(model: torch.nn.Module) -> frozenset[int]:
    """The end-of-sequence ids of the model's configuration and generation config."""
    eos = model.config.eos_token_id
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return frozenset({*_as_list(eos), *_as_list(generation_eos)})


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return list(value)
