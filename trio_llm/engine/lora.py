"""LoRA adapters in the forward pass (issue 45; vLLM's ``--enable-lora``).

A request runs with at most one adapter (`SamplingParams.lora`); one step mixes requests
of several adapters and of the base model. Each adapted product ``y = x @ W.T`` gets, for
each adapter of the step, ``y[rows] += (x[rows] @ A.T) @ (s B).T`` over the packed rows of
that adapter's requests only: one grouped pair of small products per adapter and product,
never a forward pass per adapter, and the base product runs once over every row. The
scaling ``s`` (``lora_alpha / r``) is folded into ``B`` when the adapter loads.

Where the products are:

- the engine's own decoder (`trio_llm.engine.native`): its four products per layer
  (``qkv``, ``o``, ``gate_up``, ``down``, concatenated) are wrapped (`LoraProduct`); an
  adapter's q/k/v (and gate/up) ``A`` are concatenated too, each ``B`` writes its own
  columns. A decode-only step with adapters does not take the GGUF one-call layer;
- transformers' modules (the reference path, every other family): a forward hook on each
  ``nn.Linear`` projection adds the same term (`hook_modules`).

`LoraAdapters` is the engine's set of loaded adapters, at most ``--max-cpu-loras`` of
them, least recently used first out (a request keeps its own adapter's weights alive).
`lora_fits` is the scheduler's ``--max-loras`` rule: the running batch holds requests of at
most that many adapters (a request of another waits, as in vLLM).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch

from trio_llm.config import LoRAConfig
from trio_llm.lora_files import LORA_MODULES, AdapterError, read_adapter
from trio_llm.messages import LoraRef

#: Where each module's output columns start in a product: ``{product: [(module, first
#: column)]}`` (`LoraAdapter`). Per module (transformers' modules) each is a product.
Layout = dict[str, list[tuple[str, int]]]
#: One product of one adapter: ``A`` of its modules concatenated ``[sum r, in]``, and per
#: module ``(first column, last column, first rank row, last rank row, s B [out, r])``.
_Product = tuple[torch.Tensor, list[tuple[int, int, int, int, torch.Tensor]]]

PER_MODULE: Layout = {name: [(name, 0)] for name in LORA_MODULES}


def native_layout(q_size: int, kv_size: int, intermediate: int) -> Layout:
    """The layout of `trio_llm.engine.native`'s concatenated products."""
    return {
        "qkv": [("q_proj", 0), ("k_proj", q_size), ("v_proj", q_size + kv_size)],
        "o": [("o_proj", 0)],
        "gate_up": [("gate_proj", 0), ("up_proj", intermediate)],
        "down": [("down_proj", 0)],
    }


class LoraAdapter:
    """One adapter's weights on the model's device, per ``(layer, product)``.

    Args:
        ref: the adapter (its ``path`` is read).
        base_config: the base model's ``config.json`` contents.
        max_rank: ``--max-lora-rank``.
        layout: the products' module columns (`native_layout` or `PER_MODULE`).
        dtype, device: the model's.

    Raises:
        AdapterError: the folder fails `trio_llm.lora_files.read_adapter`, or its files'
            digest is not ``ref.digest`` (they changed since the server checked them).
    """

    def __init__(
        self,
        ref: LoraRef,
        base_config: dict,
        max_rank: int,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        from safetensors.torch import load_file

        files = read_adapter(ref.path, base_config, max_rank)
        if files.digest != ref.digest:
            raise AdapterError(f"the files of adapter {ref.name!r} changed since it was loaded")
        self.name, self.digest = ref.name, ref.digest
        tensors = load_file(str(files.weights_file))
        found = {
            (m.layer, m.module): (tensors[m.a_key], tensors[m.b_key] * files.scaling)
            for m in files.modules
        }
        #: ``{(layer, product): (A, segments)}`` (`_Product`).
        self.products: dict[tuple[int, str], _Product] = {}
        applied = {m for columns in layout.values() for m, _ in columns}
        for layer, module in found:
            if module not in applied:
                raise AdapterError(
                    f"layer {layer} {module}: this model's {module} is not a projection "
                    "LoRA can be applied to here"
                )
        for layer in sorted({layer for layer, _ in found}):
            for product, columns in layout.items():
                parts = [(found[layer, m], col) for m, col in columns if (layer, m) in found]
                if parts:
                    self.products[layer, product] = _stack(parts, dtype, device)


def _stack(
    parts: list[tuple[tuple[torch.Tensor, torch.Tensor], int]],
    dtype: torch.dtype,
    device: torch.device,
) -> _Product:
    """One product's ``A`` rows concatenated and each module's ``B`` with its columns."""
    a = torch.cat([a for (a, _), _ in parts]).to(device=device, dtype=dtype).contiguous()
    segments = []
    rank_row = 0
    for (a_part, b), column in parts:
        rank = a_part.shape[0]
        b = b.to(device=device, dtype=dtype).contiguous()
        segments.append((column, column + b.shape[0], rank_row, rank_row + rank, b))
        rank_row += rank
    return a, segments


class LoraAdapters:
    """The engine's loaded adapters: at most ``config.cpu_loras``, least recently used out.

    Args:
        config: ``--max-lora-rank``, ``--max-cpu-loras``.
        model_dir: the base model's folder (its ``config.json``).
        layout: as `LoraAdapter`'s.
        dtype, device: the model's.
    """

    def __init__(
        self,
        config: LoRAConfig,
        model_dir: str | Path,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.base_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.layout, self.dtype, self.device = layout, dtype, device
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()

    def get(self, ref: LoraRef) -> LoraAdapter:
        """The adapter of ``ref``, loaded from its folder if it is not in memory.

        Raises:
            AdapterError: it cannot be loaded (`LoraAdapter`).
        """
        adapter = self._loaded.pop(ref.digest, None)
        if adapter is None:
            cfg = self.config
            args = (self.base_config, cfg.max_lora_rank, self.layout, self.dtype, self.device)
            adapter = LoraAdapter(ref, *args)
        self._loaded[ref.digest] = adapter
        while len(self._loaded) > self.config.cpu_loras:
            self._loaded.popitem(last=False)
        return adapter

    def __len__(self) -> int:
        return len(self._loaded)


class LoraBatch:
    """The adapters of one step and the packed rows of each (`from_scheduled`)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor | None]]) -> None:
        #: ``(adapter, int64 rows [n] or None for every row)``.
        self.groups = groups

    @staticmethod
    def from_scheduled(
        scheduled: Sequence[tuple[object, int]],
        adapter_of: Callable[[object], LoraAdapter | None],
        device: torch.device,
    ) -> LoraBatch | None:
        """The step's groups from its ``(request, new tokens)`` in packed order, or None
        when no request has an adapter."""
        rows: dict[str, tuple[LoraAdapter, list[int]]] = {}
        start = 0
        for request, count in scheduled:
            adapter = adapter_of(request)
            if adapter is not None:
                rows.setdefault(adapter.digest, (adapter, []))[1].extend(
                    range(start, start + count)
                )
            start += count
        if not rows:
            return None
        groups = []
        for adapter, indices in rows.values():
            every = len(rows) == 1 and len(indices) == start
            tensor = None if every else torch.tensor(indices, dtype=torch.int64, device=device)
            groups.append((adapter, tensor))
        return LoraBatch(groups)

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every adapter's term of product ``key`` to ``y`` (``[..., T, out]``, in
        place) from its input ``x`` (``[..., T, in]``), on each adapter's rows."""
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for adapter, rows in self.groups:
            product = adapter.products.get(key)
            if product is None:
                continue
            a, segments = product
            inputs = x2 if rows is None else x2.index_select(0, rows)
            low = inputs @ a.t()  # [n, sum of ranks]
            for first, last, rank_first, rank_last, b in segments:
                delta = low[:, rank_first:rank_last] @ b.t()
                if rows is None:
                    y2[:, first:last] += delta
                else:
                    y2[:, first:last].index_add_(0, rows, delta)


_CURRENT: contextvars.ContextVar[LoraBatch | None] = contextvars.ContextVar(
    "trio_llm_lora", default=None
)


@contextlib.contextmanager
def lora_step(batch: LoraBatch | None) -> Iterator[None]:
    """Make ``batch`` the adapters the products inside apply (None: none)."""
    token = _CURRENT.set(batch)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_lora() -> LoraBatch | None:
    """The `LoraBatch` of the step running, or None."""
    return _CURRENT.get()


class LoraProduct:
    """A product of the native decoder with the step's adapter terms added.

    Args:
        product: ``x [1, T, in] -> y [1, T, out]``.
        key: ``(layer index, product name)`` of `native_layout`.
    """

    def __init__(
        self, product: Callable[[torch.Tensor], torch.Tensor], key: tuple[int, str]
    ) -> None:
        self.product, self.key = product, key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        batch = _CURRENT.get()
        if batch is not None:
            y = y if y.is_contiguous() else y.contiguous()
            batch.apply(self.key, x, y)
        return y


def hook_modules(layers: Iterable[torch.nn.Module]) -> list[str]:
    """Add the step's adapter terms to transformers' projections of ``layers`` (a forward
    hook per ``nn.Linear`` named in `LORA_MODULES`); returns the modules not found
    (an adapter of those is refused: `missing_modules`)."""
    missing = []
    for index, layer in enumerate(layers):
        for name, part in LORA_MODULES.items():
            module = getattr(getattr(layer, part, None), name, None)
            if not isinstance(module, torch.nn.Linear):
                missing.append(name)
                continue
            module.register_forward_hook(_hook((index, name)))
    return sorted(set(missing))


def _hook(key: tuple[int, str]) -> Callable:
    def hook(_module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        batch = _CURRENT.get()
        if batch is None:
            return output
        output = output if output.is_contiguous() else output.contiguous()
        batch.apply(key, args[0], output)
        return output

    return hook


def lora_fits(running: Iterable[object], ref: LoraRef | None, max_loras: int) -> bool:
    """Whether a request of adapter ``ref`` may join ``running`` requests (their
    ``params.lora``) without the batch holding more than ``max_loras`` adapters."""
    if ref is None:
        return True
    held = {r.params.lora.digest for r in running if r.params.lora is not None}  # type: ignore[attr-defined]
    return ref.digest in held or len(held) < max_loras


def attach_adapter(adapters: LoraAdapters | None, request: object) -> str | None:
    """Give ``request`` (an engine `Request`) the weights of its ``params.lora``, loaded
    from the adapter's folder if they are not in memory; the error text if it cannot run
    with them (``adapters`` None: the engine serves none)."""
    ref = request.params.lora  # type: ignore[attr-defined]
    if ref is None:
        return None
    if adapters is None:
        return f"LoRA adapter {ref.name!r}: this engine serves no adapters (--enable-lora)"
    try:
        request.adapter = adapters.get(ref)  # type: ignore[attr-defined]
    except (AdapterError, OSError) as exc:
        return f"LoRA adapter {ref.name!r}: {exc}"
    return None
