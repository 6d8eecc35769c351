"""The constraints the configuration dataclasses declare on their fields, and the flags
``trio-llm serve`` derives from them."""

from __future__ import annotations

import dataclasses

import pytest

from trio_llm.cli.main import build_parser
from trio_llm.cli.serve_flags import SERVE_FLAGS
from trio_llm.config import DTYPES, CacheConfig, ModelConfig
from trio_llm.config_fields import CheckedFields, Range, setting
from trio_llm.server_config import ServerConfig


@dataclasses.dataclass(frozen=True)
class _Example(CheckedFields):
    count: int = setting(1, range=Range(1))
    limit: int | None = setting(None, range=Range(1), none_means="no limit")
    size: int = setting(1, range=Range(1, unit="byte"))
    rate: float = setting(1.0, range=Range(0, exclusive=True))
    wait: float = setting(0.0, range=Range(0))
    window: int = setting(1, range=Range(1, 8))
    mode: str | None = setting(None, choices=("a", "b"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"count": 0}, "count must be at least 1"),
        ({"limit": 0}, r"limit must be at least 1 \(or None for no limit\)"),
        ({"size": 0}, "size must be at least 1 byte"),
        ({"rate": 0.0}, "rate must be positive"),
        ({"rate": float("nan")}, "rate must be positive"),
        ({"wait": -1.0}, "wait must not be negative"),
        ({"window": 9}, "window must be between 1 and 8"),
        ({"mode": "c"}, r"mode must be one of \('a', 'b'\), got 'c'"),
    ],
)
def test_a_value_out_of_its_declared_range_names_the_field(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _Example(**changes)


def test_none_passes_only_where_the_type_allows_it() -> None:
    assert _Example(limit=None, mode=None).limit is None
    assert ServerConfig(engine_step_timeout=None).engine_step_timeout is None
    with pytest.raises(TypeError):
        _Example(count=None)


def test_the_flags_take_the_fields_defaults_and_choices() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {action.dest: action for action in serve._actions}
    assert actions["dtype"].choices == DTYPES
    assert actions["dtype"].default == ModelConfig.dtype
    assert actions["block_size"].default == CacheConfig.block_size
    assert actions["data_parallel_size"].option_strings == ["--data-parallel-size", "-dp"]
    for cls, flags in SERVE_FLAGS.items():
        assert set(flags) <= {spec.name for spec in dataclasses.fields(cls)}, cls
