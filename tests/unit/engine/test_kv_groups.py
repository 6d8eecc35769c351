"""How layers are split into KV cache groups (`KVGroups.plan`), and the pool's tensors:
no model needed."""

import os
from pathlib import Path

import torch

from trio_llm.engine.kv_cache import KVCache, KVGroups, LayerSpec

FULL = LayerSpec(num_kv_heads=1, head_dim=256)
WINDOW = LayerSpec(num_kv_heads=1, head_dim=256, sliding_window=512)


def test_gemma3_pattern_gives_groups_of_three() -> None:
    # Gemma 3 270M: five sliding layers, then one full, three times.
    specs = ([WINDOW] * 5 + [FULL]) * 3
    groups = KVGroups.plan(specs, 32768)
    assert groups.group_size == 3
    assert groups.windows == (512,) * 5 + (None,)
    sliding = [i for i, spec in enumerate(specs) if spec.sliding_window]
    assert [layer for group in groups.layers[:5] for layer in group] == sliding
    assert groups.layers[5] == (5, 11, 17)


def test_one_kind_of_layer_is_one_group() -> None:
    assert KVGroups.plan([FULL] * 4, 8192) == KVGroups(((0, 1, 2, 3),), (None,))
    # Every layer with the same window: one group that frees what the window leaves.
    assert KVGroups.plan([WINDOW] * 4, 8192).windows == (512,)


def test_a_window_that_never_binds_is_full_attention() -> None:
    assert KVGroups.plan([WINDOW, FULL], 512).windows == (None,)


def test_disabled_or_unequal_shapes_keep_one_group_of_every_block() -> None:
    specs = [WINDOW, FULL, WINDOW, FULL]
    assert KVGroups.plan(specs, 8192, hybrid=False) == KVGroups(((0, 1, 2, 3),), (None,))
    other = LayerSpec(num_kv_heads=2, head_dim=64, sliding_window=512)
    assert KVGroups.plan([other, FULL], 8192).windows == (None,)


def test_uneven_counts_split_by_their_greatest_common_divisor() -> None:
    # Qwen2 with max_window_layers=4 of 6: four full layers, then two sliding ones.
    specs = [FULL] * 4 + [WINDOW] * 2
    groups = KVGroups.plan(specs, 8192)
    assert groups.layers == ((0, 1), (2, 3), (4, 5))
    assert groups.windows == (None, None, 512)


def test_the_pool_is_zeros_that_cost_nothing_until_written() -> None:
    # A pool of 1 GiB (4 tensors): mapped, not written, so this process's resident memory grows by
    # only what is touched; every element reads as zero; views outlive the cache.
    def resident_bytes() -> int:
        fields = Path("/proc/self/statm").read_text().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    cache = KVCache([FULL] * 2, KVGroups.plan([FULL] * 2, 8192), 511, 1024, torch.bfloat16)
    assert cache.keys[0].shape == (512 * 1024, 1, 256) and cache.keys[0].dtype == torch.bfloat16
    assert resident_bytes() - before < 64 << 20
    key = cache.keys[1][:3]
    assert cache.values[1][-5:].count_nonzero() == 0 and key.count_nonzero() == 0
    del cache
    key += 1.5
    assert torch.equal(key, torch.full((3, 1, 256), 1.5, dtype=torch.bfloat16))
