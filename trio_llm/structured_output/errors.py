"""Structured output's exceptions, and llguidance's messages reduced to the one line a
client is shown (without the library's parser state dumps or backtraces)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be enforced; the message says why (one line
    of text, without the grammar library's state dumps or backtraces)."""


class SpecLimitError(StructuredOutputError):
    """A spec over one of this server's size limits (`check_spec_limits`)."""


#: What a grammar that no finite string matches is refused with.
MATCHES_NOTHING = "the grammar matches no string: no output could ever complete it"

#: llguidance's stop reasons for a matcher that can go no further before its grammar is
#: complete: at the start of a grammar, it matches nothing.
_NO_EXTENSION = ("NoExtension", "NoExtensionBias")

#: A caret line or a source excerpt ("   1 | start: foo") of a syntax error.
_EXCERPT = re.compile(r"\s*(\^+|\d+ \|.*)\s*")

#: The longest library message passed on.
_MAX_REASON_CHARS = 500


def library_reason(message: str) -> str:
    """llguidance's error as one line for a client (see `one_line`); a matcher that can
    extend nothing at the grammar's start means the grammar matches nothing."""
    reason = one_line(message)
    if reason in _NO_EXTENSION:
        return MATCHES_NOTHING
    return reason


def one_line(message: str) -> str:
    """``message`` without what is the library's business: the parser state (``<state>``),
    a panic's ``<backtrace>``, the ``<non-verbose/>`` marker and syntax errors' source
    excerpts; what remains is joined into one line and shortened."""
    lines = []
    for line in message.strip().splitlines():
        if line.lstrip().startswith("<"):
            break  # a state dump, backtrace or marker: the rest is internals
        if line.strip() and not _EXCERPT.fullmatch(line):
            lines.append(line.strip())
    text = " ".join(lines).rstrip(":;, ") or "invalid grammar"
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def internal_error_text(exc: BaseException) -> str:
    """The error of a request whose grammar failed unexpectedly (a bug in the grammar
    library or here, not the spec): the exception's type only, for the client; the
    engine logs the rest. Only that request ends (vLLM CVE-2026-105757's class)."""
    return f"structured output: internal error in the grammar ({type(exc).__name__})"


def matcher_error(matcher: llguidance.LLMatcher) -> str | None:
    """Why ``matcher`` failed (one line, as `StructuredOutputError`), or None if it did not."""
    if not matcher.is_error():
        return None
    return one_line(matcher.get_error())
