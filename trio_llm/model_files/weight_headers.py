"""The headers of weight files, read as untrusted input: a GGUF file's tensor table
(`read_gguf_header`) and a safetensors file's tensor shapes (`safetensors_weights`).

Every size a header declares (counts of key/value pairs and tensors, string and array
lengths, dimensions, tensor offsets and sizes) is checked with Python integers against the
bytes the file holds before anything is read or allocated for it, as llama.cpp's GGUF
reader does since its 2026 overflow fixes; a file that fails a check is refused with a
`WeightFileError` naming what is wrong. Reading a header costs at most one pass over it
(arrays of fixed-size values are skipped in one seek), never memory in proportion to a
declared count. A GGUF file goes through `read_gguf_header` before the ``gguf`` package's
own reader (which multiplies dimensions in 64-bit numpy integers) sees it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

#: GGUF versions read (1 had 32-bit counts; llama.cpp writes 3).
GGUF_VERSIONS = (2, 3)
#: Most dimensions of a GGUF tensor (ggml's ``GGML_MAX_DIMS``).
GGUF_MAX_DIMS = 4
#: Deepest nesting of GGUF metadata arrays (arrays of arrays).
GGUF_MAX_NESTING = 4
#: A tensor's element count, and each dimension, stay below ggml's ``INT64_MAX``.
_INT64_LIMIT = 2**63
#: GGUF metadata value types of a fixed size: their struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: Fewest bytes a metadata pair takes (an empty key, its type, one byte of value) and a
#: tensor's entry (an empty name, one dimension, its type and offset).
_MIN_PAIR_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
_DEFAULT_ALIGNMENT = 32


class WeightFileError(OSError):
    """A weight file whose header is not what its format allows (cut short, or declaring
    more than the file holds); the message says what, and where (the file's path: for the
    log, `trio_llm.api.http.errors.without_host_paths` takes it out of a response)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of a GGUF file's tensor table (checked by `read_gguf_header`).

    Attributes:
        name: the tensor's name (``blk.0.attn_q.weight``).
        ggml_type: its GGML type id.
        dims: its dimensions as GGUF lists them (innermost first: ``[K, N]``).
        offset: where its data starts, bytes from the data section's start.
        nbytes: its data's size in bytes.
    """

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What `read_gguf_header` found.

    Attributes:
        version: the GGUF version.
        num_tensors: the tensors of its table.
        num_weights: the values of every tensor together.
        data_start: where the data section starts (bytes from the file's start).
        data_bytes: the bytes of the data section the tensors span (to the end of the
            last one).
        architecture: ``general.architecture`` (``llama``, ``gemma3``), or None.
        tensors: the tensor table, in the file's order.
    """

    version: int
    num_tensors: int
    num_weights: int
    data_start: int
    data_bytes: int
    architecture: str | None = None
    tensors: tuple[GGUFTensor, ...] = ()


class _Reader:
    """Reads a header's fields in order, each size checked against what is left."""

    def __init__(self, handle: BinaryIO, size: int, name: str) -> None:
        self.handle = handle
        self.size = size
        self.name = name

    def fail(self, problem: str) -> WeightFileError:
        return WeightFileError(f"{self.name}: {problem} (at byte {self.handle.tell()})")

    @property
    def left(self) -> int:
        return self.size - self.handle.tell()

    def unpack(self, fmt: str) -> int | float | bool:
        width = struct.calcsize(fmt)
        data = self.handle.read(width)
        if len(data) < width:
            raise self.fail("the GGUF header is cut short")
        value: int | float | bool = struct.unpack(fmt, data)[0]
        return value

    def count(self, fmt: str, what: str, each: int) -> int:
        """An unsigned count of ``what`` whose items take ``each`` bytes at least."""
        value = int(self.unpack(fmt))
        if value * each > self.left:
            raise self.fail(
                f"{what}: {value} declared, more than the file's {self.left} bytes left"
            )
        return value

    def skip(self, nbytes: int) -> None:
        if nbytes > self.left:
            raise self.fail("the GGUF header is cut short")
        self.handle.seek(nbytes, 1)

    def string(self, what: str, keep: int = 0) -> bytes:
        """A string's bytes if it is at most ``keep`` long, else skipped (b"")."""
        length = self.count("<Q", f"the length of {what}", 1)
        if length <= keep:
            return self.handle.read(length)
        self.skip(length)
        return b""

    def value(self, kind: int, depth: int = 0) -> int | None:
        """Skip a metadata value of type ``kind``; an unsigned integer's value, else None."""
        if kind in _SCALARS:
            value = self.unpack(_SCALARS[kind])
            return value if kind in (4, 10) and isinstance(value, int) else None
        if kind == _STRING:
            self.string("a string value")
        elif kind == _ARRAY:
            if depth >= GGUF_MAX_NESTING:
                raise self.fail(f"metadata arrays nested deeper than {GGUF_MAX_NESTING}")
            item = int(self.unpack("<I"))
            each = (
                struct.calcsize(_SCALARS[item])
                if item in _SCALARS
                else 8
                if item == _STRING
                else 12
            )
            count = self.count("<Q", "an array's items", each)
            if item in _SCALARS:
                self.skip(count * each)
            elif item in (_STRING, _ARRAY):
                for _ in range(count):
                    self.value(item, depth + 1)
            else:
                raise self.fail(f"unknown GGUF value type {item}")
        else:
            raise self.fail(f"unknown GGUF value type {kind}")
        return None


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The tensor table of the GGUF file at ``path``, every declared size checked.

    Raises:
        WeightFileError: not a GGUF file, a version not read, a header cut short or
            declaring more than the file holds (counts, lengths, more than 4 dimensions,
            an element count past 2^63, an unknown tensor type, a row that is no whole
            number of blocks, data outside the file or not aligned).
        OSError: the file cannot be read.
    """
    path = Path(path)
    with path.open("rb") as handle:
        reader = _Reader(handle, path.stat().st_size, str(path))
        if handle.read(4) != b"GGUF":
            raise WeightFileError(f"{path} is not a GGUF file")
        version = int(reader.unpack("<I"))
        if version not in GGUF_VERSIONS:
            raise reader.fail(f"GGUF version {version} is not supported")
        num_tensors = reader.count("<Q", "tensors", _MIN_TENSOR_BYTES)
        num_pairs = reader.count("<Q", "metadata pairs", _MIN_PAIR_BYTES)
        alignment = _DEFAULT_ALIGNMENT
        architecture = None
        for _ in range(num_pairs):
            key = reader.string("a metadata key", keep=64)
            kind = int(reader.unpack("<I"))
            if key == b"general.architecture" and kind == _STRING:
                architecture = reader.string("the architecture", keep=64).decode(errors="replace")
                continue
            value = reader.value(kind)
            if key == b"general.alignment":
                if value is None or value <= 0 or value & (value - 1):
                    raise reader.fail(f"general.alignment {value} is not a power of two")
                alignment = value
        num_weights = data_bytes = 0
        sizes = _block_sizes()
        tensors = []
        for _ in range(num_tensors):
            tensor = _tensor(reader, sizes, alignment)
            tensors.append(tensor)
            num_weights += math.prod(tensor.dims)
            data_bytes = max(data_bytes, tensor.offset + tensor.nbytes)
        data_start = -(-handle.tell() // alignment) * alignment
    if data_start + data_bytes > reader.size:
        raise WeightFileError(
            f"{path}: its tensors span {data_bytes} bytes of data, more than the "
            f"{max(0, reader.size - data_start)} the file holds"
        )
    return GGUFHeader(
        version, num_tensors, num_weights, data_start, data_bytes, architecture, tuple(tensors)
    )


def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml's types: id -> (values per block, bytes per block), from the ``gguf``
    package."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): size for kind, size in GGML_QUANT_SIZES.items()}


def _tensor(reader: _Reader, sizes: dict[int, tuple[int, int]], alignment: int) -> GGUFTensor:
    """One tensor's entry, checked."""
    name = reader.string("a tensor name", keep=256).decode(errors="replace")
    num_dims = int(reader.unpack("<I"))
    if not 1 <= num_dims <= GGUF_MAX_DIMS:
        raise reader.fail(f"a tensor of {num_dims} dimensions (1 to {GGUF_MAX_DIMS})")
    dims = [int(reader.unpack("<Q")) for _ in range(num_dims)]
    elements = math.prod(dims)
    if elements >= _INT64_LIMIT or max(dims) >= _INT64_LIMIT:
        raise reader.fail(f"a tensor of {' x '.join(map(str, dims))} values (past 2^63)")
    ggml_type, offset = int(reader.unpack("<I")), int(reader.unpack("<Q"))
    if ggml_type not in sizes:
        raise reader.fail(f"unknown tensor type {ggml_type}")
    block, block_bytes = sizes[ggml_type]
    if dims[0] % block:
        raise reader.fail(f"a row of {dims[0]} values of type {ggml_type} ({block} a block)")
    if offset % alignment:
        raise reader.fail(f"a tensor's offset {offset} is not aligned to {alignment}")
    return GGUFTensor(name, ggml_type, tuple(dims), offset, elements // block * block_bytes)


def safetensors_weights(path: str | Path) -> int:
    """The number of weights in the safetensors file at ``path``, from its header (the
    ``safetensors`` library checks its size, shapes and offsets against the file).

    Raises:
        WeightFileError: a header the library refuses.
        OSError: the file cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    except SafetensorError as exc:
        raise WeightFileError(f"{path}: {exc}") from None
