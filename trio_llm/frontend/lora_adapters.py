"""The LoRA adapters a server serves over its model, by name (issue 45).

`LoraAdapters` is the API server's side: each served name's `LoraRef` (folder and digest,
checked by `trio_llm.lora_files.read_adapter` against the base model's ``config.json``).
A request whose ``model`` names an adapter runs on the base model's engine with that
``SamplingParams.lora``; the engine loads the weights when a request first needs them.
Adapters come from ``--lora-modules`` (checked at start-up: a bad one stops the server)
and, with ``--allow-runtime-lora-updating``, from ``POST /v1/load_lora_adapter``: only
folders inside ``--allowed-lora-dir`` (symbolic links followed) are read then.
Unloading a name stops new requests from naming it; requests already running keep it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trio_llm.lora_files import AdapterError, read_adapter
from trio_llm.messages import LoraRef

#: Most adapters one server lists at once (each is a name and a folder; the engine keeps
#: ``--max-cpu-loras`` of them loaded).
MAX_ADAPTERS = 1024


class LoraAdapters:
    """The served adapters of one base model.

    Args:
        model_dir: the base model's folder (its ``config.json``).
        max_rank: ``--max-lora-rank``.
        allowed_dir: the only folder runtime loads may read (``--allowed-lora-dir``);
            None: runtime loads are off.
        reserved: names that are not adapters' (the server's model names).
    """

    def __init__(
        self,
        model_dir: str | Path,
        max_rank: int,
        allowed_dir: str | Path | None = None,
        reserved: tuple[str, ...] = (),
    ) -> None:
        self.base_config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_rank = max_rank
        self.allowed_dir = None if allowed_dir is None else Path(allowed_dir).expanduser().resolve()
        self.reserved = frozenset(reserved)
        self._adapters: dict[str, LoraRef] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[LoraRef]:
        return iter(list(self._adapters.values()))

    def get(self, name: str | None) -> LoraRef | None:
        """The adapter served as ``name``, or None."""
        return None if name is None else self._adapters.get(name)

    def add(self, name: str, path: str, *, runtime: bool = False) -> LoraRef:
        """Check the folder at ``path`` and serve it as ``name`` (blocking: it hashes the
        adapter's files; run it in a worker thread from async code).

        Args:
            runtime: a load at run time: ``path`` must lie inside ``allowed_dir``.

        Raises:
            AdapterError: a name taken or empty, too many adapters, a path outside the
                allowed folder, or a folder `read_adapter` refuses (the message says).
        """
        if not name or name in self.reserved or name in self._adapters:
            raise AdapterError(f"the name {name!r} is taken or empty", "lora_name")
        if len(self._adapters) >= MAX_ADAPTERS:
            raise AdapterError(f"this server serves {MAX_ADAPTERS} adapters at most", "lora_name")
        if runtime:
            self._check_allowed(path)
        files = read_adapter(path, self.base_config, self.max_rank)
        if name in self._adapters:  # added meanwhile by another load
            raise AdapterError(f"the name {name!r} is taken", "lora_name")
        ref = LoraRef(name, str(files.path), files.digest)
        self._adapters[name] = ref
        return ref

    def remove(self, name: str) -> LoraRef:
        """Stop serving ``name`` (running requests keep it).

        Raises:
            KeyError: no adapter is served as ``name``.
        """
        return self._adapters.pop(name)

    def _check_allowed(self, path: str) -> None:
        allowed = self.allowed_dir
        if allowed is None:
            raise AdapterError("runtime adapter loads read no folder (--allowed-lora-dir)")
        try:
            resolved = Path(path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):
            raise AdapterError(f"no adapter folder at {path!r}") from None
        if not resolved.is_relative_to(allowed):
            raise AdapterError(f"{path!r} is outside the folder adapters are loaded from")
