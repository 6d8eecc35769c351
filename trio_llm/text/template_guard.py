"""Rendering a chat template that came with a request (``chat_template``, with
``--trust-request-chat-template``): Jinja's immutable sandbox, with caps on time and size.

The operator's template (the model's, ``--chat-template``) is trusted and rendered by
`trio_llm.text.chat_template.render_messages`. A client's template may loop for ever or build
a huge text in a few operations, so `render_guarded` renders it:

- in `GuardedEnvironment`, Jinja's ``ImmutableSandboxedEnvironment`` (no attribute the
  sandbox deems unsafe, no mutation of lists or dicts, ``range`` up to 100,000 items)
  where nothing may build a text, list or number larger than the render's character cap:
  the operators ``*``, ``**``, ``+`` and ``%`` and string concatenation (``~``) check their
  result's size before or right after computing it, the string methods and filters that
  can multiply a size (``replace``, ``center``, ``join``, ``indent``, ``format``, ...) check
  the bound of their result first, captured blocks and macro results are joined only
  within the cap, and ``lipsum`` is gone;
- with a deadline, checked by a trace function in the rendering thread on every line of
  the template's compiled code and every Python call it makes, so a template that loops
  is stopped wherever it is;
- counting the rendered text as it is produced, refused once past the cap.

Every refusal is a `TemplateError` (a 400 naming ``chat_template`` at the API).
"""

from __future__ import annotations

import re
import string
import sys
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import FILTERS, make_attrgetter
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from trio_llm.text.chat_template import (
    TemplateError,
    raise_template_exception,
    strftime_now,
    template_json,
)

#: Most bits of an integer a template may compute (``**`` and ``*`` of integers).
MAX_INT_BITS = 64 * 1024
#: Largest ``indent`` of the ``tojson`` filter.
MAX_JSON_INDENT = 64
#: The file name Jinja gives a template's compiled code (`_trace` watches its lines).
_TEMPLATE_FILE = "<template>"
#: A ``%`` conversion's flags, width and precision; and the numbers in a spec.
_PRINTF = re.compile(r"%[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class TemplateLimits:
    """Caps on rendering a request's chat template.

    Attributes:
        timeout: seconds the rendering may take.
        max_chars: characters of the rendered text, and the most any text, list or dict
            built on the way may hold.
    """

    timeout: float
    max_chars: int


#: Caps of a render whose caller gave none.
DEFAULT_LIMITS = TemplateLimits(timeout=2.0, max_chars=1024 * 1024)


class _Exceeded(BaseException):
    """A cap was passed (a BaseException, so no ``except Exception`` in code the template
    calls can swallow it)."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int


_BUDGET: ContextVar[_Budget] = ContextVar("template_budget")


def _budget() -> _Budget:
    budget = _BUDGET.get(None)
    if budget is None:  # the environment used outside `render_guarded`
        raise SecurityError("a guarded template renders only through render_guarded")
    return budget


def _refuse(message: str) -> None:
    """Stop the render in progress with ``message`` (at compile time, where Jinja
    evaluates constant expressions, a `SecurityError` from `_budget` keeps them for the
    render instead)."""
    _budget()
    raise _Exceeded(message)


def _need(size: int, what: str) -> None:
    """Refuse a value of ``size`` characters (or items) past the render's cap."""
    limit = _budget().max_chars
    if size > limit:
        _refuse(f"the chat template builds {what} of more than {limit} characters")


def _weight(value: Any) -> int:
    """The characters ``value`` holds, nested values counted each time they appear (what
    printing it would cost, roughly); counting stops just past the cap."""
    limit = _budget().max_chars
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, list | tuple):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += 1
    return total


def _sized(value: Any) -> Any:
    """``value``, once its `_weight` is known to be within the cap."""
    if isinstance(value, str | bytes | list | tuple | dict):
        _need(_weight(value), "a value")
    return value


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        _refuse(f"the chat template computes a number of more than {MAX_INT_BITS} bits")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left operator right`` where its result would pass the caps."""
    sequence = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequence):
            left, right = right, left
        if isinstance(left, sequence) and isinstance(right, int):
            _need(_weight(left) * max(right, 0), "a repeated value")
        elif isinstance(left, int) and isinstance(right, int):
            _check_int_bits(left.bit_length() + right.bit_length())
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1:
            _check_int_bits(left.bit_length() * right)
    elif operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        _need(_weight(left) + _weight(right), "a joined value")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left)


def _check_printf(template: str) -> None:
    """Refuse a ``%`` format whose widths or precisions could pass the cap."""
    limit = _budget().max_chars
    for spec in _PRINTF.findall(template):
        if "*" in spec or any(int(n) > limit for n in _DIGITS.findall(spec)):
            _refuse("the chat template formats with a width past its cap")


def _check_format(template: str) -> None:
    """Refuse a ``str.format`` template whose field widths could pass the cap."""
    limit = _budget().max_chars
    for _literal, _field, spec, _conversion in string.Formatter().parse(template):
        if spec and ("{" in spec or any(int(n) > limit for n in _DIGITS.findall(spec))):
            _refuse("the chat template formats with a width past its cap")


def _replace_bound(text: str, old: str, new: str, count: int = -1) -> int:
    times = len(text) + 1 if not old else len(text) // len(old)
    if count is not None and count >= 0:
        times = min(times, count)
    return len(text) + times * len(new)


def _join(separator: str, items: Iterable[Any]) -> list[Any]:
    """``items`` as a list, once their join with ``separator`` is known to fit."""
    listed = list(items)
    size = len(separator) * max(len(listed) - 1, 0)
    _need(size + sum(len(str(item)) for item in listed), "a joined text")
    return listed


def _width(value: Any) -> None:
    if isinstance(value, int):
        _need(value, "a padded text")


def _str_method(owner: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    """Check a call of ``owner.name(*args, **kwargs)``; returns the arguments to call with."""
    if name == "replace" and len(args) >= 2:
        _need(_replace_bound(owner, str(args[0]), str(args[1]), *args[2:3]), "a replaced text")
    elif name in ("center", "ljust", "rjust", "zfill") and args:
        _width(args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        _need(len(owner) * max(int(size), 1), "an expanded text")
    elif name == "join" and args:
        return (_join(owner, args[0]),)
    elif name in ("format", "format_map"):
        _check_format(owner)
    elif name in ("translate", "maketrans"):
        raise SecurityError(f"str.{name} is not allowed in a request's chat template")
    return args


def _center_filter(value: Any, width: int = 80) -> str:
    _width(width)
    return FILTERS["center"](value, width)


def _indent_filter(
    value: str, width: int | str = 4, first: bool = False, blank: bool = False
) -> str:
    pad = len(width) if isinstance(width, str) else max(int(width), 0)
    _need(len(str(value)) + (str(value).count("\n") + 1) * pad, "an indented text")
    return FILTERS["indent"](value, width, first, blank)


@jinja2.pass_eval_context
def _join_filter(context: Any, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
    if attribute is not None:
        value = map(make_attrgetter(context.environment, attribute), value)
    return FILTERS["join"](context, _join(str(d), value), d)


@jinja2.pass_environment
def _sum_filter(
    environment: Any, iterable: Iterable[Any], attribute: Any = None, start: Any = 0
) -> Any:
    items = list(iterable)
    if isinstance(start, list | tuple | str):
        _need(_weight(start) + _weight(items), "a summed value")
    return _sized(FILTERS["sum"](environment, items, attribute, start))


@jinja2.pass_eval_context
def _replace_filter(context: Any, value: str, old: str, new: str, count: int | None = None) -> str:
    _need(_replace_bound(str(value), str(old), str(new), count or -1), "a replaced text")
    return FILTERS["replace"](context, value, old, new, count)


def _format_filter(value: str, *args: Any, **kwargs: Any) -> str:
    _check_printf(str(value))
    return _sized(FILTERS["format"](value, *args, **kwargs))


def _batch_filter(value: Any, linecount: int, fill_with: Any = None) -> Any:
    _width(linecount)
    return FILTERS["batch"](value, linecount, fill_with)


def _slice_filter(value: Any, slices: int, fill_with: Any = None) -> Any:
    _width(slices)
    return FILTERS["slice"](value, slices, fill_with)


def _tojson_filter(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    if indent is not None and int(indent) > MAX_JSON_INDENT:
        _refuse(f"tojson indents by at most {MAX_JSON_INDENT}")
    return _sized(template_json(value, ensure_ascii=ensure_ascii, indent=indent))


@jinja2.pass_environment
def _wordwrap_filter(environment: Any, s: str, width: int = 79, *args: Any, **kwargs: Any) -> str:
    wrap = kwargs.get("wrapstring", args[1] if len(args) > 1 else None) or "\n"
    _need(len(str(s)) * (len(str(wrap)) + 1), "a wrapped text")
    return FILTERS["wordwrap"](environment, s, width, *args, **kwargs)


#: The filters that can multiply a size, replaced by checked ones.
_CHECKED_FILTERS: dict[str, Callable[..., Any]] = {
    "center": _center_filter,
    "indent": _indent_filter,
    "join": _join_filter,
    "sum": _sum_filter,
    "replace": _replace_filter,
    "format": _format_filter,
    "batch": _batch_filter,
    "slice": _slice_filter,
    "tojson": _tojson_filter,
    "wordwrap": _wordwrap_filter,
}


class _Buffer(list):
    """A captured block's output (a macro's, ``{% set %}...{% endset %}``, a filter
    block's), counted as it grows."""

    size = 0

    def append(self, part: Any) -> None:
        self.size += len(part)
        _need(self.size, "a block")
        super().append(part)

    def extend(self, parts: Iterable[Any]) -> None:
        for part in parts:
            self.append(part)


class _CheckedCode(CodeGenerator):
    """Compiles ``a ~ b`` so that its result is checked against the cap, and captured
    blocks into a `_Buffer`."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.sized(")
        super().visit_Concat(node, frame)
        self.write(")")

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox of a request's chat template (see the module's docstring); its caps
    are those of the `render_guarded` call in progress."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CheckedCode

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.filters.update(_CHECKED_FILTERS)
        self.globals.pop("lipsum", None)
        self.globals["raise_exception"] = raise_template_exception
        self.globals["strftime_now"] = strftime_now

    @staticmethod
    def sized(value: Any) -> Any:
        """``value``, once it is known to be within the cap."""
        return _sized(value)

    @staticmethod
    def new_buffer() -> list[Any]:
        """A captured block's output list, counted against the cap (`_Buffer`)."""
        return _Buffer()

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's sandboxed ``str.format``, once the format's widths are within the cap."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped

    @staticmethod
    def concat(parts: Iterable[Any]) -> str:  # type: ignore[override]
        """A captured block or macro result: joined only within the cap."""
        listed = list(parts)
        _need(sum(len(part) for part in listed), "a block")
        return "".join(listed)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):
            args = _str_method(owner, getattr(obj, "__name__", ""), args, kwargs)
        return _sized(super().call(context, obj, *args, **kwargs))


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    try:
        return GuardedEnvironment().from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"invalid chat template: {exc}") from exc
    except (RecursionError, MemoryError):
        raise TemplateError("invalid chat template: it nests too deeply") from None


def _trace(deadline: float, timeout: float) -> Callable[..., Any]:
    """A trace function that stops the thread's template past ``deadline``: at each line
    of the template's code and each Python call made while it renders."""

    def check(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if time.monotonic() > deadline:
            raise _Exceeded(f"the chat template took longer than {timeout:g} s to render")
        return check if frame.f_code.co_filename == _TEMPLATE_FILE else None

    return check


def render_guarded(source: str, variables: dict[str, Any], limits: TemplateLimits) -> str:
    """Render ``source`` with ``variables`` in `GuardedEnvironment`, within ``limits``,
    on the calling thread (run it in a worker thread: it may take ``limits.timeout``).

    Raises:
        TemplateError: the template is invalid, raised an error, did what the sandbox
            forbids, or passed a cap (time, size of the text or of a value on the way).
    """
    deadline = time.monotonic() + limits.timeout
    token = _BUDGET.set(_Budget(deadline, limits.max_chars))
    previous = sys.gettrace()
    sys.settrace(_trace(deadline, limits.timeout))
    try:
        parts, size = [], 0
        for part in _compile(source).generate(**variables):
            size += len(part)
            _need(size, "a text")
            parts.append(part)
        return "".join(parts)
    except _Exceeded as exc:
        raise TemplateError(f"cannot apply the chat template: {exc}") from None
    except SecurityError as exc:
        raise TemplateError(f"the chat template did what is not allowed: {exc}") from None
    except (RecursionError, MemoryError):
        raise TemplateError("cannot apply the chat template: it nests or grows too far") from None
    except TemplateError:
        raise
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise TemplateError(f"cannot apply the chat template: {problem}") from None
    finally:
        sys.settrace(previous)
        _BUDGET.reset(token)
