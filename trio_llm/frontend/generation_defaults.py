"""Server-side sampling defaults: vLLM's ``--generation-config`` and
``--override-generation-config``.

A model folder's ``generation_config.json`` (Hugging Face's) may recommend sampling
settings (``temperature``, ``top_p``, ...) and an output length (``max_new_tokens``). As
in vLLM:

- ``--generation-config auto`` (the default) reads the served model's folder,
  ``vllm`` reads nothing (the API's own defaults), and any other value is a folder
  holding a ``generation_config.json``. A folder without the file gives no defaults.
- ``--override-generation-config`` (a JSON object) is laid over what was read.
- Of the result, ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
  ``repetition_penalty`` are the defaults of requests that leave those fields unset;
  ``max_new_tokens`` is the ``max_tokens`` of requests that give none.
- ``max_new_tokens`` also caps every request's output (a larger ``max_tokens`` is
  lowered to it) when it comes from ``--override-generation-config``, or from the file of
  an explicit ``--generation-config`` folder; from the model's own file (``auto``) it
  is only a default.

Other keys (``do_sample``, ``bos_token_id``, ...) are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``--generation-config`` values that name no folder.
GENERATION_CONFIG_MODES = ("auto", "vllm")

#: The sampling fields a generation config may set a default for (vLLM's list).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults of the requests that leave fields unset, and a cap on every output.

    Attributes:
        sampling: field name (`SAMPLING_KEYS`) -> default value.
        max_tokens: the ``max_tokens`` of a request that gives none (None: the rest of
            the context).
        max_tokens_cap: the most output tokens any request gets (None: no cap).
    """

    sampling: dict[str, float | int] = field(default_factory=dict)
    max_tokens: int | None = None
    max_tokens_cap: int | None = None


def check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse values `load_generation_defaults` could not use.

    Raises:
        ValueError: naming the key: a sampling value that is not a number, or a
            ``max_new_tokens`` that is not a positive integer.
    """
    for key in SAMPLING_KEYS:
        value = overrides.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
    value = overrides.get("max_new_tokens")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {value!r}")


def load_generation_defaults(
    mode: str, model_dir: str | Path, overrides: dict[str, Any] | None = None
) -> GenerationDefaults:
    """The `GenerationDefaults` of ``--generation-config mode`` for the model in
    ``model_dir``, with ``overrides`` (``--override-generation-config``) laid over them.

    Raises:
        ValueError: a ``generation_config.json`` that is not a JSON object, or values
            of the wrong type in it or in ``overrides`` (`check_overrides`).
    """
    overrides = dict(overrides or {})
    check_overrides(overrides)
    config: dict[str, Any] = {}
    if mode != "vllm":
        folder = Path(model_dir) if mode == "auto" else Path(mode)
        path = folder / "generation_config.json"
        if path.is_file():
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} must hold a JSON object")
            try:
                check_overrides(loaded)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            config = loaded
    config.update(overrides)
    sampling = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    max_tokens = config.get("max_new_tokens")
    if mode in GENERATION_CONFIG_MODES:
        cap = overrides.get("max_new_tokens")
    else:  # an explicit folder: its max_new_tokens is a server-wide limit (vLLM's rule)
        cap = max_tokens
    return GenerationDefaults(sampling, max_tokens, cap)
