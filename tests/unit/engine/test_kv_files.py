"""Block files of the prefix cache's disk tier as untrusted input (issue 44): every file
that is not exactly the block asked for is refused before a tensor is made, and the tier
keeps its bound."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from trio_llm.engine import kv_files
from trio_llm.engine.disk_tier import DiskTier

SPACE = kv_files.namespace({"model": "m", "block_size": 4})
KEY = bytes(range(32))
SHAPES = [(4, 2, 8), (4, 2, 8)]
DTYPE = torch.bfloat16


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(DTYPE) for shape in SHAPES]


def _decode(data: bytes, **changes: object) -> list[torch.Tensor]:
    args: dict[str, object] = {"space": SPACE, "group": 0, "key": KEY, "dtype": DTYPE}
    args.update(changes)
    return kv_files.decode(data, shapes=SHAPES, **args)  # type: ignore[arg-type]


def _with_header(data: bytes, **fields: object) -> bytes:
    """``data`` with header fields replaced (its payload kept)."""
    start = len(kv_files.MAGIC)
    (length,) = struct.unpack_from("<I", data, start)
    header = json.loads(data[start + 4 : start + 4 + length])
    header.update(fields)
    raw = json.dumps(header).encode()
    return kv_files.MAGIC + struct.pack("<I", len(raw)) + raw + data[start + 4 + length :]


def test_a_block_comes_back_bit_for_bit() -> None:
    tensors = _tensors()
    back = _decode(kv_files.encode(SPACE, 0, KEY, tensors))
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))


@pytest.mark.parametrize(
    "change",
    [
        {"space": kv_files.namespace({"model": "other", "block_size": 4})},
        {"group": 1},
        {"key": bytes(32)},
        {"dtype": torch.float16},
    ],
    ids=["another namespace", "another group", "another key", "another dtype"],
)
def test_another_blocks_file_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(kv_files.BlockFileError):
        _decode(kv_files.encode(SPACE, 0, KEY, _tensors()), **change)


def test_every_truncation_and_every_flipped_byte_is_refused() -> None:
    data = kv_files.encode(SPACE, 0, KEY, _tensors())
    for cut in range(0, len(data), 7):
        with pytest.raises(kv_files.BlockFileError):
            _decode(data[:cut])
    for index in range(0, len(data), 5):
        flipped = bytearray(data)
        flipped[index] ^= 0x01
        with pytest.raises(kv_files.BlockFileError):
            _decode(bytes(flipped))


@pytest.mark.parametrize(
    "fields",
    [
        {"shapes": [[4, 2, 8], [1 << 40, 1 << 20, 8]]},
        {"payload_bytes": 1 << 60},
        {"version": 2},
        {"sha256": "0" * 64},
    ],
    ids=["huge shapes", "huge payload", "another version", "another checksum"],
)
def test_a_hostile_header_is_refused(fields: dict[str, object]) -> None:
    data = _with_header(kv_files.encode(SPACE, 0, KEY, _tensors()), **fields)
    with pytest.raises(kv_files.BlockFileError):
        _decode(data)


def test_a_header_length_past_the_file_is_refused_unread() -> None:
    data = kv_files.encode(SPACE, 0, KEY, _tensors())
    start = len(kv_files.MAGIC)
    for length in (len(data), kv_files.MAX_HEADER_BYTES + 1, 0xFFFFFFFF):
        hostile = data[:start] + struct.pack("<I", length) + data[start + 4 :]
        with pytest.raises(kv_files.BlockFileError):
            _decode(hostile)


def _tier(folder: Path, max_bytes: int = 1 << 30) -> DiskTier:
    return DiskTier(folder, SPACE, max_bytes, DTYPE, SHAPES)


def test_the_tier_writes_reads_and_refuses_links_folders_and_giants(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tensors = _tensors()
    assert tier.read(0, KEY) is None and tier.counters.misses == 1
    assert tier.offer(0, KEY, tensors)
    tier.flush()
    back = tier.read(0, KEY)
    assert back is not None and all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))
    assert tier.counters.hits == 1
    assert not list(tier.folder.glob(".*.tmp"))  # written under a temporary name, renamed

    path = tier.folder / tier.name(0, KEY)
    target = tmp_path / "elsewhere.kv"
    os.replace(path, target)
    path.symlink_to(target)
    assert tier.read(0, KEY) is None  # a link is never followed
    assert not path.exists() and not path.is_symlink() and target.exists()

    path.mkdir()
    assert tier.read(0, KEY) is None
    path.rmdir()
    path.write_bytes(b"\0" * (tier.max_file_bytes + 1))
    assert tier.read(0, KEY) is None  # longer than a block's file: refused unread
    assert tier.counters.refused == 3
    tier.close()


def test_the_folder_keeps_its_bound(tmp_path: Path) -> None:
    one = len(kv_files.encode(SPACE, 0, KEY, _tensors()))
    tier = _tier(tmp_path, max_bytes=10 * one)
    for i in range(40):
        tier.offer(0, i.to_bytes(32, "big"), _tensors(i))
        tier.flush()
    sizes = [p.stat().st_size for p in tier.folder.glob("*.kv")]
    assert 0 < sum(sizes) <= 10 * one
    assert tier.counters.evicted == 40 - len(sizes)
    # The least recently used went first: the newest block is still there.
    assert tier.read(0, (39).to_bytes(32, "big")) is not None
    tier.close()


def test_a_full_disk_stops_the_writing_and_reads_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)
    tier.offer(0, KEY, _tensors())
    tier.flush()

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("trio_llm.engine.disk_tier.os.replace", full)
    assert tier.offer(0, bytes(32), _tensors(1))
    tier.flush()
    assert not tier.writing
    assert not list(tier.folder.glob(".*.tmp"))  # the half-written file is gone
    assert not tier.offer(0, bytes(31) + b"\1", _tensors(2)) and tier.counters.dropped == 1
    assert tier.read(0, KEY) is not None  # what is on disk is still read
    tier.close()


def test_two_tiers_on_one_folder_write_and_read_each_others_blocks(tmp_path: Path) -> None:
    """Two engines (or servers) of one model: every block written once, readable by both;
    a killed writer's temporary file is removed by the next tier opened there."""
    first, second = _tier(tmp_path), _tier(tmp_path)
    keys = [i.to_bytes(32, "big") for i in range(30)]
    for i, key in enumerate(keys):
        first.offer(0, key, _tensors(i))
        second.offer(0, key, _tensors(i))
    first.flush()
    second.flush()
    assert len(list(first.folder.glob("*.kv"))) == len(keys)
    for i, key in enumerate(keys):
        back = second.read(0, key)
        assert back is not None and torch.equal(back[0], _tensors(i)[0])
    stale = first.folder / f".{first.name(0, keys[0])}.999999999.dead.tmp"
    stale.write_bytes(b"half a block")
    third = _tier(tmp_path)
    assert not stale.exists()
    for tier in (first, second, third):
        tier.close()


def test_the_tier_is_on_by_default_in_the_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_llm.config import PREFIX_CACHE_DIR_ENV, engine_config

    monkeypatch.delenv(PREFIX_CACHE_DIR_ENV, raising=False)
    folder = engine_config(download_dir=str(tmp_path)).prefix_cache_folder()
    assert folder == tmp_path / "prefix-cache"
    monkeypatch.setenv(PREFIX_CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert engine_config().prefix_cache_folder() == tmp_path / "elsewhere"
    monkeypatch.setenv(PREFIX_CACHE_DIR_ENV, "none")
    assert engine_config().prefix_cache_folder() is None
    assert engine_config(prefix_cache_dir=str(tmp_path)).prefix_cache_folder() == tmp_path
    assert engine_config(prefix_cache_dir="none").prefix_cache_folder() is None
    off = engine_config(prefix_cache_dir=str(tmp_path), enable_prefix_caching=False)
    assert off.prefix_cache_folder() is None
