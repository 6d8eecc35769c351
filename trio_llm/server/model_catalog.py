"""The models one server can serve: every ``--model`` (with its ``--served-model-name``
aliases) and every model found in ``--models-dir``.

A `Catalog` maps each name a client may put in ``model`` to a `CatalogEntry`: the
``--model`` string the engine loads and the names it answers to. It only looks at the
file system (cheap, no weights read): a ``.gguf`` file, a Hugging Face folder (a
``config.json``) or a sentence-transformers folder (``modules.json`` beside its
``config.json``) directly in the models folder is one entry, named after the file (without
``.gguf``) or the folder. `Catalog.rescan` reads the folder again (``POST
/models/reload``): entries of files that appeared are added, those whose file is gone are
dropped; the ``--model`` entries never change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trio_llm.model_files.loader import is_cross_encoder
from trio_llm.server_config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    """One model the server can serve.

    Attributes:
        names: the names clients use in ``model``; the first is the one listed (and
            reported in responses) first.
        model: what the engine loads (`trio_llm.config.ModelConfig.model`): a path or a
            named model.
        source: ``flag`` (a ``--model``) or ``dir`` (found in ``--models-dir``).
        kind: ``gguf``, ``hf`` (a Hugging Face folder), ``sentence-transformers``,
            ``cross-encoder`` (a sequence-classification folder) or ``named`` (a model
            known by name, `trio_llm.model_files.named_models`), as far as the file system
            tells.
    """

    names: tuple[str, ...]
    model: str
    source: Literal["flag", "dir"]
    kind: str

    @property
    def name(self) -> str:
        """The first (listed) name."""
        return self.names[0]

    @property
    def root(self) -> str:
        """What its model card shows as ``root``: the ``--model`` string as given, as
        vLLM's cards do, where it is no path on this machine (a named model); else its
        name (a response names no host path)."""
        local = self.kind != "named" or self.model.startswith(("/", "~", "."))
        return self.name if self.source == "dir" or local else self.model


def _kind_of(path: Path) -> str | None:
    """What a models folder entry holds, or None for anything else."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        if is_cross_encoder(path):
            return "cross-encoder"
        return "sentence-transformers" if (path / "modules.json").is_file() else "hf"
    return None


def scan_models_dir(folder: Path) -> list[CatalogEntry]:
    """The models directly in ``folder``, in name order (hidden entries skipped).

    Raises:
        NotADirectoryError: ``folder`` is not a folder.
    """
    if not folder.is_dir():
        raise NotADirectoryError(f"--models-dir {folder} is not a folder")
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        kind = _kind_of(path)
        if kind is None:
            continue
        name = path.stem if kind == "gguf" else path.name
        entries.append(CatalogEntry((name,), str(path.resolve()), "dir", kind))
    return entries


class Catalog:
    """Every model of the server, by each of its names.

    Args:
        flagged: the ``--model`` entries, in order (the first is the default model).
        models_dir: the ``--models-dir`` folder, or None.

    Raises:
        ValueError: no model at all, or one name given to two ``--model`` entries.
        NotADirectoryError: ``models_dir`` is not a folder.
    """

    def __init__(self, flagged: Sequence[CatalogEntry], models_dir: Path | None = None) -> None:
        self.models_dir = models_dir
        self._flagged = list(flagged)
        seen: dict[str, str] = {}
        for entry in self._flagged:
            for name in entry.names:
                if name in seen:
                    raise ValueError(
                        f"the served model name {name!r} is given to both {seen[name]!r} "
                        f"and {entry.model!r}"
                    )
                seen[name] = entry.model
        self._entries: list[CatalogEntry] = []
        self._by_name: dict[str, CatalogEntry] = {}
        self.rescan()
        if not self._entries:
            where = f" and --models-dir {models_dir} holds none" if models_dir else ""
            raise ValueError(f"no model to serve: give --model{where}")

    @property
    def entries(self) -> list[CatalogEntry]:
        """Every entry: the ``--model`` ones first, then the folder's in name order."""
        return list(self._entries)

    @property
    def default(self) -> CatalogEntry:
        """The model a request without ``model`` gets: the first entry."""
        return self._entries[0]

    def names(self) -> list[str]:
        """Every name clients may use, each entry's names in order."""
        return [name for entry in self._entries for name in entry.names]

    def get(self, name: str) -> CatalogEntry | None:
        """The entry ``name`` names, or None."""
        return self._by_name.get(name)

    def rescan(self) -> tuple[list[CatalogEntry], list[CatalogEntry]]:
        """Read ``--models-dir`` again; return the entries added and removed. A folder
        model whose name a ``--model`` entry already has is left out (with a warning).

        Raises:
            NotADirectoryError: the folder is gone.
        """
        found = scan_models_dir(self.models_dir) if self.models_dir is not None else []
        by_name = {name: entry for entry in self._flagged for name in entry.names}
        entries = list(self._flagged)
        for entry in found:
            if entry.name in by_name:
                logger.warning(
                    f"--models-dir: {entry.model} is not served: the name {entry.name!r} "
                    f"is taken by {by_name[entry.name].model!r}"
                )
                continue
            by_name[entry.name] = entry
            entries.append(entry)
        added = [entry for entry in entries if entry not in self._entries]
        removed = [entry for entry in self._entries if entry not in entries]
        self._entries, self._by_name = entries, by_name
        return added, removed


def default_served_name(model: str) -> str:
    """The name a second (or later) ``--model`` without ``--served-model-name`` is served
    under: as ``--models-dir`` names its entries, a ``.gguf`` file's name without
    ``.gguf``, a folder's name; a model that is no path on this machine (a named model)
    by its own string."""
    path = Path(model).expanduser()
    if not path.exists():
        return model
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    return path.resolve().name if path.name in ("", "..") else path.name


def flagged_entries(
    models: Sequence[str], served_names: Iterable[Sequence[str]] = ()
) -> list[CatalogEntry]:
    """The catalog entries of the ``--model`` flags: the i-th ``--served-model-name``
    group names the i-th ``--model``. A model without one answers to its own string if
    it is the first (vLLM's rule), else to `default_served_name`'s (its file or folder
    name: a host path is no model name).

    Raises:
        ValueError: more ``--served-model-name`` groups than ``--model`` flags, or an
            empty name.
    """
    groups = [tuple(group) for group in served_names]
    if len(groups) > len(models):
        raise ValueError(
            f"{len(groups)} --served-model-name groups for {len(models)} --model flags: "
            "give one group per --model, in the same order"
        )
    entries = []
    for i, model in enumerate(models):
        kind = _kind_of(Path(model).expanduser()) or "named"
        if i < len(groups) and groups[i]:
            names = groups[i]
        else:
            names = (model if i == 0 else default_served_name(model),)
        if any(not name for name in names):
            raise ValueError("a served model name must not be empty")
        entries.append(CatalogEntry(tuple(dict.fromkeys(names)), model, "flag", kind))
    return entries


def catalog_of(config: ServerConfig) -> Catalog:
    """The catalog of a server's configuration: its ``--model`` flags (or its one model)
    and its ``--models-dir``.

    Raises:
        ValueError: as `Catalog`.
        NotADirectoryError: as `Catalog`.
    """
    models = config.models
    folder = Path(models.models_dir).expanduser() if models.models_dir is not None else None
    flagged = list(models.flagged)
    if not flagged and folder is None:
        flagged = [(config.engine.model.model, config.model_names())]
    entries = flagged_entries([model for model, _ in flagged], [names for _, names in flagged])
    return Catalog(entries, folder)
