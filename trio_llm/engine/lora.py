"""LoRA adapters in the forward pass (issue 45; vLLM's ``--enable-lora``).

A request runs with at most one adapter (`SamplingParams.lora`); one step mixes requests
of several adapters and of the base model. The base product ``y = x @ W.T`` runs once over
every packed row, then each adapted product adds ``((x @ A_S.T) * M) @ B_S.T``: ``A_S``
holds the step's adapters' ``A`` side by side (each adapter its own rank columns), the
mask ``M`` zeroes, in each row, the columns of the adapters it does not run with (all of
them for a base-model row), and ``B_S`` (scaled by ``lora_alpha / r`` when the adapter
loads) is applied module by module: the rank columns of one module (the q of every
adapter, then the k, ...) are contiguous, and each module's output columns get one
``addmm_`` with that module's ``B`` of every adapter side by side, never the zero blocks
of the other modules. One product, a mask and an ``addmm_`` per module, whatever the
number of adapters: never a forward pass per adapter, and no gather or scatter of rows
(the rank columns a row does not use cost less than moving the rows would at these
ranks). `_Stack` builds the side-by-side matrices once per set of adapters and keeps them
for the next steps.

Where the products are:

- the engine's own decoder (`trio_llm.engine.native`): its four products per layer
  (``qkv``, ``o``, ``gate_up``, ``down``, concatenated) are wrapped (`LoraProduct`); an
  adapter's q/k/v (and gate/up) ``A`` are concatenated too, each module's ``B`` at its own
  output columns. A decode-only step with adapters does not take the GGUF one-call layer;
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
#: One product of one adapter: ``A`` of its modules concatenated ``[R, in]`` (in the
#: layout's module order), and per module ``(first output column, its rank, s B
#: [module width, rank])``.
_Product = tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]
#: One module's share of a stacked product: ``(first output column, first and last + 1
#: rank column, B [module width, its rank columns])``.
_Segment = tuple[int, int, int, torch.Tensor]
#: How many sets of a step's adapters keep their products stacked (`_Stack`).
STACKS_KEPT = 8

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
            (m.layer, m.module): (tensors[m.a_key], tensors[m.b_key].float() * files.scaling)
            for m in files.modules
        }
        #: ``{(layer, product): (A, B)}`` (`_Product`).
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
    """One product's ``A`` rows concatenated and each module's ``B`` with its output
    column (`_Product`)."""
    a = torch.cat([a for (a, _), _ in parts]).to(device=device, dtype=dtype).contiguous()
    modules = [
        (column, a_part.shape[0], b.to(device=device, dtype=dtype).contiguous())
        for (a_part, b), column in parts
    ]
    return a, modules


class _Stack:
    """The products of a set of adapters side by side: for each ``(layer, product)``,
    ``A`` ``[R, in]`` of every adapter having it (grouped by module: every adapter's q
    rows, then every adapter's k rows, ...), each module's `_Segment`, and which adapter
    (its index in the set) each of the ``R`` rank columns belongs to. Built on first use."""

    def __init__(self, adapters: list[LoraAdapter]) -> None:
        self.adapters = adapters
        self._products: dict[tuple[int, str], tuple | None] = {}
        self._owners: dict[tuple[int, ...], torch.Tensor] = {}

    def get(self, key: tuple[int, str]) -> tuple | None:
        """``(A, segments, column owners)`` of product ``key``, or None (no adapter of
        the set adapts it)."""
        if key not in self._products:
            self._products[key] = self._build(key)
        return self._products[key]

    def _build(self, key: tuple[int, str]) -> tuple | None:
        found = [
            (i, adapter.products[key])
            for i, adapter in enumerate(self.adapters)
            if key in adapter.products
        ]
        if not found:
            return None
        if len(found) == 1:  # one adapter: its own matrices, no copy
            i, (a, modules) = found[0]
            segments, first = [], 0
            for column, rank, b in modules:
                segments.append((column, first, first + rank, b))
                first += rank
            return a, segments, self._owner((i,) * a.shape[0], a.device)
        by_column: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for i, (a, modules) in found:
            first = 0
            for column, rank, b in modules:
                by_column.setdefault(column, []).append((i, a[first : first + rank], b))
                first += rank
        rows, owners, segments = [], [], []
        for column in sorted(by_column):
            start = len(owners)
            for i, a_part, _ in by_column[column]:
                rows.append(a_part)
                owners += [i] * a_part.shape[0]
            b = torch.cat([b for _, _, b in by_column[column]], dim=1)
            segments.append((column, start, len(owners), b))
        a = torch.cat(rows).contiguous()
        return a, segments, self._owner(tuple(owners), a.device)

    def _owner(self, owners: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """One owners tensor per pattern: a step builds one mask per pattern, not per
        layer."""
        if owners not in self._owners:
            self._owners[owners] = torch.tensor(owners, device=device)
        return self._owners[owners]


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
        #: Stacked products of the sets of adapters steps ran with, least recent first.
        self._stacks: OrderedDict[tuple[str, ...], _Stack] = OrderedDict()

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

    def batch(
        self,
        scheduled: Sequence[tuple[object, int]],
        adapter_of: Callable[[object], LoraAdapter | None],
    ) -> LoraBatch | None:
        """The `LoraBatch` of a step's ``(request, new tokens)`` in packed order, or None
        when no request has an adapter."""
        adapters: dict[str, int] = {}
        found: list[LoraAdapter] = []
        indices: list[tuple[int, int]] = []  # (adapter index or -1, new tokens) a request
        for request, count in scheduled:
            adapter = adapter_of(request)
            index = -1
            if adapter is not None:
                index = adapters.setdefault(adapter.digest, len(found))
                if index == len(found):
                    found.append(adapter)
            indices.append((index, count))
        if not found:  # a step of the base model alone: no per-row work
            return None
        key = tuple(adapters)
        stack = self._stacks.pop(key, None) or _Stack(found)
        self._stacks[key] = stack
        while len(self._stacks) > STACKS_KEPT:
            self._stacks.popitem(last=False)
        if len(found) == 1 and all(index == 0 for index, _ in indices):
            return LoraBatch(stack, None)
        owner = [index for index, count in indices for _ in range(count)]
        return LoraBatch(stack, torch.tensor(owner, dtype=torch.int64, device=self.device))


class LoraBatch:
    """The adapters of one step (`LoraAdapters.batch`): their products stacked, and which
    adapter each packed row runs with.

    Args:
        stack: the step's adapters' products (`_Stack`).
        owner: int64 ``[T]``: each packed row's adapter (its index in the stack; -1: the
            base model); None when every row runs with the stack's one adapter.
    """

    def __init__(self, stack: _Stack, owner: torch.Tensor | None) -> None:
        self.stack, self.owner = stack, owner
        self._masks: dict[int, torch.Tensor] = {}

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the adapters' terms of product ``key`` to ``y`` (``[..., T, out]``, in
        place) from its input ``x`` (``[..., T, in]``): ``(x A^T)`` with each row's
        columns of other adapters zeroed, then each module's columns of ``y`` plus that
        times its ``B^T``: one product, a mask and an ``addmm_`` per module, for any
        number of adapters."""
        found = self.stack.get(key)
        if found is None:
            return
        a, segments, owners = found
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        low = x2 @ a.t()  # [T, R]
        if self.owner is not None:
            mask = self._masks.get(id(owners))
            if mask is None:
                mask = (self.owner[:, None] == owners[None, :]).to(low.dtype)
                self._masks[id(owners)] = mask
            low.mul_(mask)
        for column, first, last, b in segments:
            y2[:, column : column + b.shape[0]].addmm_(low[:, first:last], b.t())


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
