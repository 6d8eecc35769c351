"""The value types of ``trio-llm serve``'s flags: text -> a checked value, or an
`argparse.ArgumentTypeError` whose message argparse prints after the flag's name."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from trio_llm.server_config import MAX_STREAM_INTERVAL, keep_alive_seconds

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"4294967296"``, ``"4GiB"``, ``"512M"`` -> bytes (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def _bounded_int(text: str, low: int, high: int | None, what: str) -> int:
    """``int(text)`` if it lies in ``[low, high]``, else an argparse error naming ``what``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return value


def parse_port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0 picks a free one)."""
    return _bounded_int(text, 0, 65535, "a TCP port (0-65535)")


def parse_positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _bounded_int(text, 1, None, "a positive integer")


def parse_stream_interval(text: str) -> int:
    """A stream interval: an integer from 1 to `MAX_STREAM_INTERVAL` (tokens)."""
    return _bounded_int(text, 1, MAX_STREAM_INTERVAL, f"an integer from 1 to {MAX_STREAM_INTERVAL}")


def parse_num_threads(text: str) -> int | str:
    """A positive thread count, or ``auto``."""
    if text == "auto":
        return text
    return _bounded_int(text, 1, None, "a positive integer or auto")


def parse_non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _bounded_int(text, 0, None, "a non-negative integer")


def parse_seconds(text: str) -> float:
    """A non-negative, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


def parse_share(text: str) -> float:
    """A share of a whole: a number above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"not a share above 0 and at most 1: {text!r}")
    return value


#: The keys of ``--structured-outputs-config`` this server takes (vLLM's names).
STRUCTURED_OUTPUTS_KEYS = ("disable_additional_properties",)


def parse_structured_outputs_config(text: str) -> dict[str, bool]:
    """vLLM's ``--structured-outputs-config``: a JSON object of `STRUCTURED_OUTPUTS_KEYS`
    (true or false each).

    Raises:
        argparse.ArgumentTypeError: not such an object (says which key or value).
    """
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    for key, setting in value.items():
        if key not in STRUCTURED_OUTPUTS_KEYS:
            raise argparse.ArgumentTypeError(
                f"{key!r} is not supported here; supported: {list(STRUCTURED_OUTPUTS_KEYS)}"
            )
        if not isinstance(setting, bool):
            raise argparse.ArgumentTypeError(f"{key} must be true or false, got {setting!r}")
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object (``--override-generation-config``), its values checked."""
    from trio_llm.frontend.generation_defaults import check_overrides

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    try:
        check_overrides(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_duration(text: str) -> float | None:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"``, ``"3600"`` -> seconds; ``"0"`` or
    ``"none"`` -> None (no limit)."""
    value = text.strip().lower()
    if value in ("0", "none"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration like 30d, 12h, 90m or 3600s: {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def parse_size_or_none(text: str) -> int | None:
    """As `parse_bytes`; ``"0"`` or ``"none"`` -> None (no limit)."""
    return None if text.strip().lower() in ("0", "none") else parse_bytes(text)


def parse_keep_alive(text: str) -> float | None:
    """``--keep-alive``: seconds (`trio_llm.server_config.keep_alive_seconds`); None:
    forever."""
    try:
        return keep_alive_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry, as vLLM takes it: ``name=path``, or a JSON object
    ``{"name": ..., "path": ...}`` (a ``base_model_name`` in it must be left out or be
    the served model: adapters apply to it); returns ``(name, path)``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
        name, path = (value.get("name"), value.get("path")) if isinstance(value, dict) else (0, 0)
        if not isinstance(name, str) or not isinstance(path, str):
            raise argparse.ArgumentTypeError(f"needs string fields name and path: {text!r}")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"an empty name or path: {text!r}")
    return name.strip(), path.strip()
