"""The file of one KV block on disk (`trio_llm.engine.disk_tier`), written and read back as
untrusted input.

A file is a magic line, the length of a JSON header, the header, and the payload: the
block's keys and values, layer by layer (keys then values), as raw bytes of the cache's
dtype. The header names the format version, the tier's namespace (model, dtype, layout,
block size: `namespace`), the KV cache group and block key it holds, the dtype, the shape
of each tensor, the payload's length and its sha256. `decode` checks every one of them
against what the reader expects, with Python integers against the file's length, before
any tensor is made: a truncated, corrupted, foreign or hostile file is refused
(`BlockFileError`), never read past its end or into another model's cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence

import torch

#: The first bytes of every block file.
MAGIC = b"TRIOKV1\n"
#: The format version in the header; another one is refused.
FORMAT_VERSION = 1
#: The largest header read (bytes): a header claiming more is refused unread.
MAX_HEADER_BYTES = 64 * 1024
_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LENGTH.size


class BlockFileError(ValueError):
    """A block file that is not the block it should be (the message says why)."""


def namespace(fields: dict[str, object]) -> str:
    """The tier's namespace: a hex sha256 over ``fields`` (format version, the model's
    digest, dtypes, quantization, block size, each group's layer shapes); blocks of
    another namespace are never read."""
    text = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def encode(space: str, group: int, key: bytes, tensors: Sequence[torch.Tensor]) -> bytes:
    """The file of one block: ``tensors`` are its keys and values (``[block_size, H, D]``
    each, one dtype, contiguous on the CPU), in layer order, keys before values.

    Raises:
        ValueError: tensors of several dtypes.
    """
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one dtype per block, got {sorted(map(str, dtypes))}")
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    header = {
        "version": FORMAT_VERSION,
        "namespace": space,
        "group": group,
        "key": key.hex(),
        "dtype": str(tensors[0].dtype).removeprefix("torch."),
        "shapes": [list(t.shape) for t in tensors],
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(raw)) + raw + payload


def decode(
    data: bytes,
    space: str,
    group: int,
    key: bytes,
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, ...]],
) -> list[torch.Tensor]:
    """The tensors of a block file, checked against what the reader expects.

    Args:
        data: the whole file.
        space, group, key: the namespace, KV cache group and block key it must hold.
        dtype, shapes: the cache's dtype and each tensor's shape, as `encode` wrote them.

    Returns:
        One tensor per shape (views of one buffer copied from ``data``).

    Raises:
        BlockFileError: anything that is not that block: a short or foreign file, a
            header of another version, namespace, group, key, dtype or shapes, a payload
            of another length, or one whose sha256 differs.
    """
    header = _header(data)
    expected = {
        "version": FORMAT_VERSION,
        "namespace": space,
        "group": group,
        "key": key.hex(),
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": [list(shape) for shape in shapes],
    }
    for field, value in expected.items():
        if header.get(field) != value:
            raise BlockFileError(f"its {field} is not this tier's")
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = sum(math.prod(shape) for shape in shapes) * itemsize
    start = _PREFIX + _LENGTH.unpack_from(data, len(MAGIC))[0]
    if header.get("payload_bytes") != size or len(data) - start != size:
        raise BlockFileError(f"a payload of {len(data) - start} bytes, not {size}")
    payload = memoryview(data)[start:]  # no copy: the tensors below copy it once
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BlockFileError("its payload's sha256 does not match its header")
    flat = torch.frombuffer(bytearray(payload), dtype=dtype)
    tensors, offset = [], 0
    for shape in shapes:
        count = math.prod(shape)
        tensors.append(flat[offset : offset + count].view(shape))
        offset += count
    return tensors


def _header(data: bytes) -> dict[str, object]:
    """The JSON header of ``data``, its length checked against the file first."""
    if len(data) < _PREFIX or not data.startswith(MAGIC):
        raise BlockFileError("not a KV block file (no magic)")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > MAX_HEADER_BYTES or _PREFIX + length > len(data):
        raise BlockFileError(f"a header of {length} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[_PREFIX : _PREFIX + length])
    except (UnicodeDecodeError, ValueError) as exc:
        raise BlockFileError(f"a header that is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise BlockFileError("a header that is not a JSON object")
    return header
