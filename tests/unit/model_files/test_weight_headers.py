"""Weight file headers as untrusted input (`trio_llm.model_files.weight_headers`; issue 41:
"the GGUF reader checks every declared size with Python integers against the file before
allocating"): a fuzz test of GGUF headers (valid ones built field by field, then one
declared size made hostile, or the file cut short) and hostile safetensors headers.

Every case ends in a correct read or a `WeightFileError`, never another exception, and
takes memory bounded by the file's size, not by what its header declares (tracemalloc's
peak)."""

from __future__ import annotations

import math
import struct
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import gguf.constants  # noqa: F401  (imported by the reader on first use: not counted)
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trio_llm.model_files.weight_headers import (
    WeightFileError,
    read_gguf_header,
    safetensors_weights,
)
from trio_llm.server.model_memory import weight_bytes

#: Most bytes a header read may allocate (the largest file here is a few KiB).
PEAK_BYTES = 256 * 1024
#: ggml types used here: id -> (values per block, bytes per block): F32, F16, Q4_0, Q8_0.
TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34)}
#: What a hostile size is replaced with (each kept to its field's width).
HOSTILE = (0, 1, 3, 2**31, 2**32 - 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


@dataclass
class Field:
    """One field of a GGUF header: its struct format and value, and whether it declares
    a size (a count, a length, a dimension, a type, an offset)."""

    fmt: str
    value: int | float | bytes
    size: bool = False

    def encode(self) -> bytes:
        if self.fmt == "raw":
            assert isinstance(self.value, bytes)
            return self.value
        width = struct.calcsize(self.fmt)
        value = self.value
        if isinstance(value, int) and self.fmt.isupper():
            value &= (1 << (8 * width)) - 1
        return struct.pack(self.fmt, value)


def _string(text: bytes) -> list[Field]:
    return [Field("<Q", len(text), size=True), Field("raw", text)]


#: Metadata values: (GGUF type, struct format) of the scalars used.
SCALARS = [(4, "<I"), (5, "<i"), (6, "<f"), (10, "<Q"), (7, "<?"), (0, "<B")]

names = st.binary(min_size=0, max_size=12)
scalars = st.sampled_from(SCALARS).flatmap(
    lambda kind: st.tuples(st.just(kind), st.integers(0, 100))
)
values = st.one_of(
    scalars.map(lambda s: ("scalar", s)),
    names.map(lambda text: ("string", text)),
    st.tuples(st.sampled_from(SCALARS), st.lists(st.integers(0, 100), max_size=5)).map(
        lambda a: ("array", a)
    ),
    st.lists(names, max_size=4).map(lambda items: ("strings", items)),
    st.lists(st.lists(names, max_size=3), max_size=3).map(lambda items: ("nested", items)),
)


def _value(value: tuple) -> list[Field]:
    kind, content = value
    if kind == "scalar":
        (code, fmt), number = content
        return [Field("<I", code, size=True), Field(fmt, float(number) if fmt == "<f" else number)]
    if kind == "string":
        return [Field("<I", 8, size=True), *_string(content)]
    if kind == "array":
        (code, fmt), items = content
        fields = [Field("<I", 9, size=True), Field("<I", code, size=True)]
        fields.append(Field("<Q", len(items), size=True))
        return fields + [Field(fmt, float(i) if fmt == "<f" else i) for i in items]
    if kind == "strings":
        fields = [Field("<I", 9, size=True), Field("<I", 8, size=True)]
        fields.append(Field("<Q", len(content), size=True))
        return fields + [f for item in content for f in _string(item)]
    fields = [Field("<I", 9, size=True), Field("<I", 9, size=True)]  # arrays of string arrays
    fields.append(Field("<Q", len(content), size=True))
    for inner in content:
        fields += [Field("<I", 8, size=True), Field("<Q", len(inner), size=True)]
        fields += [f for item in inner for f in _string(item)]
    return fields


tensors = st.lists(
    st.tuples(
        st.sampled_from(sorted(TYPES)),
        st.lists(st.integers(1, 3), min_size=0, max_size=3),  # dims after the first
        st.integers(1, 2),  # the first dimension, in blocks
    ),
    max_size=4,
)


def _gguf(pairs: list[tuple[bytes, tuple]], specs: list, version: int) -> tuple[list[Field], int]:
    """The fields of a valid GGUF file (its data section last) and its number of weights."""
    fields = [Field("raw", b"GGUF"), Field("<I", version, size=True)]
    fields += [Field("<Q", len(specs), size=True), Field("<Q", len(pairs), size=True)]
    for key, value in pairs:
        fields += _string(key) + _value(value)
    offset = weights = 0
    layout = []
    for index, (kind, rest, blocks) in enumerate(specs):
        block, block_bytes = TYPES[kind]
        dims = [blocks * block, *rest]
        layout.append((f"t{index}".encode(), dims, kind, offset))
        weights += math.prod(dims)
        offset += -(-(math.prod(dims) // block * block_bytes) // 32) * 32
    for name, dims, kind, start in layout:
        fields += [*_string(name), Field("<I", len(dims), size=True)]
        fields += [Field("<Q", dim, size=True) for dim in dims]
        fields += [Field("<I", kind, size=True), Field("<Q", start, size=True)]
    header = sum(len(f.encode()) for f in fields)
    fields.append(Field("raw", b"\0" * (-header % 32 + offset)))
    return fields, weights


def _read(path: Path):
    """`read_gguf_header`'s answer or its `WeightFileError`, and the read's peak memory."""
    tracemalloc.start()
    try:
        result = read_gguf_header(path)
    except WeightFileError as exc:
        result = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return result, peak


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf") / "fuzz.gguf"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pairs=st.lists(st.tuples(names, values), max_size=5),
    specs=tensors,
    version=st.sampled_from([2, 3]),
    mutation=st.none() | st.tuples(st.integers(0, 10**6), st.sampled_from(HOSTILE)),
    cut=st.none() | st.integers(0, 10**6),
)
def test_a_hostile_gguf_header_is_refused_cleanly(
    gguf_path: Path, pairs, specs, version, mutation, cut
) -> None:
    fields, weights = _gguf(pairs, specs, version)
    sized = [f for f in fields if f.size]
    if mutation is not None:
        field = sized[mutation[0] % len(sized)]
        field.value = mutation[1]
    data = b"".join(f.encode() for f in fields)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    gguf_path.write_bytes(data)
    result, peak = _read(gguf_path)
    assert peak < PEAK_BYTES
    event("refused" if isinstance(result, WeightFileError) else "read")
    if isinstance(result, WeightFileError):
        assert mutation is not None or cut is not None, result  # a valid file is read
        return
    assert result.data_start + result.data_bytes <= len(data)
    if mutation is None and cut is None:
        assert result.num_weights == weights and result.num_tensors == len(specs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda f: f.__setitem__(3, Field("<Q", 2**64 - 1)),
            "metadata pairs: 18446744073709551615",
        ),
        (lambda f: f.__setitem__(2, Field("<Q", 2**62)), "tensors: 4611686018427387904"),
        (lambda f: f.__setitem__(1, Field("<I", 1)), "GGUF version 1"),
    ],
)
def test_each_refusal_names_what_is_wrong(tmp_path: Path, change, message: str) -> None:
    fields, _ = _gguf([(b"k", ("string", b"v"))], [(0, [2], 1)], 3)
    change(fields)
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"".join(f.encode() for f in fields))
    with pytest.raises(WeightFileError, match=message) as refused:
        read_gguf_header(path)
    assert str(refused.value).startswith(f"{path}: ")  # for the log: which file


def test_a_tensor_of_4_x_2_62_elements_is_refused(tmp_path: Path) -> None:
    """Item 5's file: a header that claims 4 x 2^62 values (the estimate read it as 2^64
    weights; the gguf package's numpy product wraps around)."""
    fields, _ = _gguf([], [(0, [1], 1)], 3)
    dims = [f for f in fields if f.size and f.fmt == "<Q"][-3:-1]
    dims[0].value, dims[1].value = 4, 2**62
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"".join(f.encode() for f in fields))
    with pytest.raises(WeightFileError, match=r"past 2\^63"):
        read_gguf_header(path)
    with pytest.raises(OSError, match=r"huge\.gguf"):
        weight_bytes(str(path), 4)


def _safetensors(header: bytes, declared: int | None = None, data: int = 0) -> bytes:
    length = len(header) if declared is None else declared
    return struct.pack("<Q", length) + header + b"\0" * data


@pytest.mark.parametrize(
    "raw",
    [
        _safetensors(b"{}", declared=2**63),  # a header length past the file: no allocation
        _safetensors(b"{}", declared=2**64 - 1),
        _safetensors(b'{"w": {"dtype": "F32", "shape": [4611686018427387904, 4], '
                     b'"data_offsets": [0, 16]}}', data=16),
        _safetensors(b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1024]}}',
                     data=16),
        _safetensors(b'{"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}', data=8),
        _safetensors(b"[1, 2]"),
        b"\x01",
    ],
)  # fmt: skip
def test_a_hostile_safetensors_header_is_refused(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(WeightFileError, match=r"bad\.safetensors"):
            safetensors_weights(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < PEAK_BYTES
