"""LoRA adapter folders in PEFT's format, read as untrusted input (issue 45).

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
``save_pretrained``). `read_adapter` checks everything the engine relies on before any
weight is loaded, with the same rules in the API server (a runtime load's 400) and the
engine (the load itself): the config is a plain LoRA (no DoRA, no trained biases, no
``modules_to_save``, no per-module rank or alpha patterns), every tensor is a ``lora_A`` or
``lora_B`` of one of the seven projections of a decoder layer (`LORA_MODULES`), of the base
model's shapes (`module_shapes`: from its ``config.json``, so an adapter of another base
model is refused), with one rank no larger than ``--max-lora-rank``. The tensors' shapes
come from the safetensors header (the ``safetensors`` library checks it against the file);
pickled ``adapter_model.bin`` files are refused. An adapter is identified by `digest`, a
SHA-256 of both files: the engine's cache and the prefix cache's keys use it, so changed
files are a different adapter.

No torch here: the API server reads headers only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The projections an adapter may target, and the part of a decoder layer holding each.
LORA_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Largest ``adapter_config.json`` read (PEFT writes about 1 KB).
MAX_CONFIG_BYTES = 1 << 20
#: A tensor key PEFT saves: ``base_model.model.[model.]layers.N.PART.MODULE.lora_X.weight``.
_KEY = re.compile(
    r"base_model\.model\.(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
    r"(\w+)\.(\w+)\.lora_([AB])\.weight"
)
#: Config entries that change what the weights mean in ways the engine does not apply.
_REFUSED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "fan_in_fan_out": "fan_in_fan_out weights",
}


#: The safetensors dtypes of adapter weights.
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class AdapterError(ValueError):
    """An adapter the server cannot serve right; the message names the problem, ``param``
    the request field at fault (``lora_path``, or ``lora_name`` for the name)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: ``y += scaling * (x @ A.T) @ B.T``.

    Attributes:
        layer: the decoder layer's index.
        module: its name in `LORA_MODULES`.
        a_key, b_key: the safetensors keys of ``A`` ``[rank, in]`` and ``B`` ``[out, rank]``.
    """

    layer: int
    module: str
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterFiles:
    """A checked adapter folder (`read_adapter`).

    Attributes:
        path: the folder, resolved (symbolic links followed).
        digest: hex SHA-256 of the config and weights files.
        rank: the LoRA rank ``r``.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
        modules: the adapted projections.
        base_model: the config's ``base_model_name_or_path`` (informative only).
    """

    path: Path
    digest: str
    rank: int
    scaling: float
    modules: tuple[AdapterModule, ...]
    base_model: str | None

    @property
    def weights_file(self) -> Path:
        return self.path / ADAPTER_WEIGHTS


def module_shapes(config: Mapping[str, Any]) -> tuple[int, dict[str, tuple[int, int]]]:
    """The base model's decoder layers and each projection's ``(in, out)`` features, from
    its ``config.json`` contents (a multimodal config's ``text_config`` where it has one).

    Raises:
        AdapterError: the config lacks the sizes (not a decoder this knows).
    """
    text = config.get("text_config") or config
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        inter = int(text["intermediate_size"])
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"the base model's config has no decoder sizes ({exc})") from None
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return layers, shapes


def read_adapter(path: str | Path, base_config: Mapping[str, Any], max_rank: int) -> AdapterFiles:
    """Check the adapter folder at ``path`` against the base model (module docstring).

    Args:
        path: the folder PEFT saved.
        base_config: the base model's ``config.json`` contents.
        max_rank: ``--max-lora-rank``.

    Raises:
        AdapterError: the message names what is wrong (a missing or unreadable file, a
            config the engine cannot apply, a module, shape or rank out of bounds).
    """
    folder = Path(path).expanduser()
    try:
        folder = folder.resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        raise AdapterError(f"no adapter folder at {str(path)!r}") from None
    if not folder.is_dir():
        raise AdapterError(f"{str(path)!r} is not a folder")
    config, config_bytes = _read_config(folder)
    rank, scaling = _rank_and_scaling(config)
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is over --max-lora-rank {max_rank}")
    modules = _check_tensors(folder / ADAPTER_WEIGHTS, base_config, rank)
    digest = hashlib.sha256(config_bytes)
    with (folder / ADAPTER_WEIGHTS).open("rb") as handle:
        digest.update(hashlib.file_digest(handle, "sha256").digest())
    base = config.get("base_model_name_or_path")
    return AdapterFiles(folder, digest.hexdigest(), rank, scaling, modules, base and str(base))


def _read_config(folder: Path) -> tuple[dict[str, Any], bytes]:
    """The folder's ``adapter_config.json``, parsed, and its bytes."""
    file = folder / ADAPTER_CONFIG
    try:
        with file.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        raise AdapterError(f"the adapter folder has no readable {ADAPTER_CONFIG}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{ADAPTER_CONFIG} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise AdapterError(f"{what} cannot be served ({ADAPTER_CONFIG}: {key})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"trained biases cannot be served (bias {config.get('bias')!r})")
    return config, data


def _rank_and_scaling(config: Mapping[str, Any]) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{ADAPTER_CONFIG}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{ADAPTER_CONFIG}: lora_alpha must be a number, got {alpha!r}")
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / root


def _check_tensors(
    file: Path, base_config: Mapping[str, Any], rank: int
) -> tuple[AdapterModule, ...]:
    """Every tensor of ``file`` as a projection's ``A`` or ``B`` of the base's shapes."""
    from safetensors import SafetensorError, safe_open

    num_layers, shapes = module_shapes(base_config)
    found: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    if not file.is_file():
        missing = (
            "adapter_model.bin (pickle) is not loaded" if file.with_suffix(".bin").exists() else ""
        )
        raise AdapterError(f"the adapter folder has no {ADAPTER_WEIGHTS} {missing}".rstrip())
    try:
        with safe_open(str(file), framework="numpy") as handle:
            for key in handle.keys():
                match = _KEY.fullmatch(key)
                if match is None or LORA_MODULES.get(match[3]) != match[2]:
                    raise AdapterError(
                        f"{ADAPTER_WEIGHTS}: {key!r} is not a module LoRA is applied to here"
                    )
                layer = int(match[1])
                if layer >= num_layers:
                    raise AdapterError(
                        f"{key!r}: the base model has {num_layers} layers (an adapter of "
                        "another base model?)"
                    )
                tensor = handle.get_slice(key)
                if tensor.get_dtype() not in _FLOAT_DTYPES:
                    raise AdapterError(f"{key!r} holds {tensor.get_dtype()}, not floats")
                shape = list(tensor.get_shape())
                found.setdefault((layer, match[3]), {})[match[4]] = (key, shape)
    except SafetensorError as exc:
        raise AdapterError(f"{ADAPTER_WEIGHTS} cannot be read: {exc}") from None
    modules = []
    for (layer, name), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {name}: lora_A and lora_B must both be present")
        (a_key, a_shape), (b_key, b_shape) = pair["A"], pair["B"]
        in_features, out_features = shapes[name]
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise AdapterError(
                f"layer {layer} {name}: lora_A {a_shape} and lora_B {b_shape} do not fit the "
                f"base model ([{rank}, {in_features}] and [{out_features}, {rank}] expected): "
                "an adapter of another base model?"
            )
        modules.append(AdapterModule(layer, name, a_key, b_key))
    if not modules:
        raise AdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    return tuple(modules)
