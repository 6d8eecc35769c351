"""Configuration dataclass fields that declare their own constraints.

A field made by `setting` carries its allowed ``choices`` or numeric `Range` in its
metadata; `check_fields` checks every such field of a dataclass instance, in field order
(a dataclass deriving from `CheckedFields` runs it after ``__init__``), and raises a
`ValueError` whose message names the field. Checks that involve two fields stay in the
dataclass's ``__post_init__``. The command line (`trio_llm.cli.main`) reads the same metadata:
its ``choices`` are these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Allowed numbers: at least ``low`` (above it when ``exclusive``), at most ``high``.

    Attributes:
        low: the smallest value allowed (with ``exclusive``, the largest one refused).
        high: the largest value allowed; None: no upper bound.
        exclusive: ``low`` itself is refused ("must be positive" with ``low=0``).
        unit: appended to ``low`` in the message ("at least 1 byte").
    """

    low: float
    high: float | None = None
    exclusive: bool = False
    unit: str = ""

    def allows(self, value: float) -> bool:
        """Whether ``value`` lies in the range (NaN never does)."""
        above = value > self.low if self.exclusive else value >= self.low
        return bool(above) and (self.high is None or value <= self.high)

    def requirement(self) -> str:
        """What the message says a value must be, e.g. ``"must be at least 1"``."""
        if self.high is not None:
            if self.exclusive:
                return f"must be above {self.low} and at most {self.high}"
            return f"must be between {self.low} and {self.high}"
        if self.low == 0:
            return "must be positive" if self.exclusive else "must not be negative"
        unit = f" {self.unit}" if self.unit else ""
        return f"must be at least {self.low}{unit}"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    choices: tuple[str, ...] | None = None,
    range: Range | None = None,
    none_means: str | None = None,
    repr: bool = True,
) -> Any:
    """A `dataclasses.field` whose value `check_fields` checks.

    Args:
        choices: the values allowed (and None, where the field's type is ``X | None``).
        range: the numbers allowed (and None, where the field's type is ``X | None``).
        none_means: what None stands for, named in the range message
            (``"... (or None for no limit)"``).
        repr: as `dataclasses.field`'s.
    """
    metadata = {"choices": choices, "range": range, "none_means": none_means}
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=repr, metadata=metadata
    )


def check_fields(config: Any) -> None:
    """Check each `setting` field of the dataclass instance ``config`` against its declared
    ``choices`` or `Range`; None passes where the field's type allows it (``X | None``).

    Raises:
        ValueError: the first field out of range, e.g. ``"dtype must be one of ('auto',
            'float32', 'bfloat16'), got 'float16'"`` or ``"block_size must be at least 1"``.
    """
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if value is None and str(spec.type).endswith("| None"):
            continue
        choices = spec.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{spec.name} must be one of {choices}, got {value!r}")
        allowed = spec.metadata.get("range")
        if allowed is not None and not allowed.allows(value):
            none_means = spec.metadata.get("none_means")
            suffix = f" (or None for {none_means})" if none_means else ""
            raise ValueError(f"{spec.name} {allowed.requirement()}{suffix}")


class CheckedFields:
    """Base of the configuration dataclasses: `check_fields` runs after ``__init__``
    (a subclass with rules over two fields calls ``super().__post_init__()`` first)."""

    def __post_init__(self) -> None:
        check_fields(self)
