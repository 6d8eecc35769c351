"""The start-up probe: whether a model's attention reaches the paged KV cache.

`probe_layers` runs the decoder once on one token with an `AttentionProbe` in place of
the step's metadata (`trio_llm.engine.attention_metadata.step_metadata`):
`trio_llm.engine.attention.paged_attention` hands each layer's call to the probe, which
records the layer's key/value shapes from its actual projections, its sliding window and
softcap (`LayerSpec`), and refuses what the paged attention cannot do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trio_llm.engine.attention import ATTENTION_NAME
from trio_llm.engine.attention_metadata import step_metadata
from trio_llm.engine.kv_cache import LayerSpec
from trio_llm.engine.support import describe
from trio_llm.errors import EngineConfigError

#: Keyword arguments layers pass to the attention function that `paged_attention` may
#: ignore (they matter only to other kernels, to training, or carry our own metadata).
IGNORED_ATTENTION_KWARGS = frozenset(
    {"dropout", "position_ids", "paged", "output_attentions", "is_causal", "use_cache"}
)


@dataclass
class AttentionProbe:
    """What `probe_layers` makes current (`step_metadata`) for its one-token forward pass:
    `paged_attention` hands it each layer's call, which records the layer's `LayerSpec`
    instead of attending.

    Attributes:
        layers: ``layer_idx`` → the layer's spec, in call order.
        problems: why a layer cannot be served by `paged_attention`, one line each.
    """

    layers: dict[int, LayerSpec] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sliding_window: int | None,
        softcap: float | None,
        kwargs: dict[str, object],
    ) -> tuple[torch.Tensor, None]:
        """Record one layer's call; returns zeros of the attention output's shape."""
        layer = getattr(module, "layer_idx", None)
        name = type(module).__name__
        if not isinstance(layer, int):
            self.problems.append(f"{name} has no integer layer_idx")
        elif layer in self.layers:
            self.problems.append(f"layer {layer} attends twice in one forward pass")
        if key.shape[1:] != value.shape[1:] or key.shape[-1] != query.shape[-1]:
            self.problems.append(
                f"{name}: keys {tuple(key.shape)}, values {tuple(value.shape)} and "
                f"queries {tuple(query.shape)} differ in shape (only equal head sizes are "
                "implemented)"
            )
        if query.shape[1] % key.shape[1]:
            self.problems.append(f"{name}: {query.shape[1]} query heads over {key.shape[1]}")
        for arg, value_ in kwargs.items():
            if arg == "s_aux" and value_ is not None:
                self.problems.append(f"{name} uses attention sinks (not implemented)")
            elif arg == "is_causal" and value_ is False:
                self.problems.append(f"{name} attends bidirectionally (is_causal=False)")
            elif arg not in IGNORED_ATTENTION_KWARGS and value_ is not None:
                self.problems.append(f"{name} passes {arg}={value_!r}, which is not implemented")
        if isinstance(layer, int):
            self.layers[layer] = LayerSpec(
                num_kv_heads=key.shape[1],
                head_dim=key.shape[-1],
                sliding_window=None if sliding_window is None else int(sliding_window),
                softcap=None if softcap is None else float(softcap),
            )
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        return out, None


@torch.inference_mode()
def probe_layers(
    decoder: torch.nn.Module, num_layers: int, device: torch.device
) -> list[LayerSpec]:
    """Learn every attention layer's `LayerSpec` from one forward pass of one token.

    Args:
        decoder: the model's decoder (``model.get_decoder()``), loaded with
            ``attn_implementation=ATTENTION_NAME``.
        num_layers: decoder layers the configuration declares.
        device: where the model lives.

    Returns:
        One spec per layer, indexed by ``layer_idx`` (``0 .. num_layers - 1``).

    Raises:
        ValueError: why this model's attention cannot be served by `paged_attention`:
            no layer called it (its attention does not go through transformers' attention
            interface), some layers have none (recurrent or hybrid layers), or a layer
            needs what is not implemented (attention sinks, bidirectional attention,
            unequal key/value head sizes, unknown arguments).
    """
    probe = AttentionProbe()
    with step_metadata(probe):
        decoder(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            use_cache=False,
        )
    if not probe.layers and not probe.problems:
        raise ValueError("its attention does not go through transformers' attention interface")
    if probe.problems:
        raise ValueError("; ".join(dict.fromkeys(probe.problems)))
    missing = sorted(set(range(num_layers)) - set(probe.layers))
    if missing:
        raise ValueError(
            f"layers {missing} of {num_layers} do not attend through transformers' attention "
            "interface (recurrent or hybrid layers are not implemented)"
        )
    if len(probe.layers) != num_layers:
        raise ValueError(
            f"attention layers {sorted(probe.layers)} do not match the {num_layers} decoder "
            "layers its configuration declares"
        )
    return [probe.layers[i] for i in range(num_layers)]


def probe_model(model: torch.nn.Module) -> list[LayerSpec]:
    """Switch ``model`` to the paged attention (`ATTENTION_NAME`) and probe its layers
    (`probe_layers`): one spec per decoder layer.

    Raises:
        EngineConfigError: its attention cannot be served by the paged attention.
    """
    mconf = model.config
    if getattr(mconf, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    device = next(model.parameters()).device
    try:
        return probe_layers(model.get_decoder(), mconf.num_hidden_layers, device)
    except ValueError as exc:
        raise EngineConfigError(f"{describe(mconf)} is not supported: {exc}") from exc
