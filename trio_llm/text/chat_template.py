"""Rendering a model's Jinja chat template without importing transformers or torch.

The environment matches what Hugging Face chat templates are written against (see the
transformers documentation on chat templating): a sandboxed, immutable Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter, and the globals ``raise_exception`` and ``strftime_now``. The template sees
``messages``, ``tools``, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template raised an error (``raise_exception``) or could not be rendered."""


def raise_template_exception(message: str) -> None:
    """A template's ``raise_exception(message)``: a `TemplateError`."""
    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    """A template's ``strftime_now(format)``: the local time so formatted."""
    return datetime.now().strftime(fmt)


def template_json(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any
) -> str:
    """A template's ``tojson`` filter: JSON, not HTML-escaped (as transformers renders)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (cached by source text).

    Raises:
        TemplateError: the template is not valid Jinja.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = template_json
    env.globals["raise_exception"] = raise_template_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"invalid chat template: {exc}") from exc


#: Tool-aware templates shipped with trio_llm (``trio_llm/templates/``) for models whose
#: own template cannot show tools, by the SHA-256 of that template (stripped).
TOOL_TEMPLATES = {
    # SmolLM2-Instruct (135M, 360M, 1.7B share it)
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": "smollm2_tools.jinja",
}


def shipped_template(name: str) -> str:
    """The text of a template shipped in ``trio_llm/templates/``."""
    return resources.files("trio_llm").joinpath("templates", name).read_text(encoding="utf-8")


def tool_template_for(source: str | None) -> str | None:
    """The template to render a conversation with tools: ``source`` itself when it reads
    the ``tools`` variable, a shipped tool-aware version of it when there is one, else
    None (the template cannot show tools to the model)."""
    if source is None:
        return None
    if "tools" in source:
        return source
    digest = hashlib.sha256(source.strip().encode("utf-8")).hexdigest()
    name = TOOL_TEMPLATES.get(digest)
    return shipped_template(name) if name is not None else None


#: Variables of a chat template that ``chat_template_kwargs`` may not set (the server
#: gives them), besides the tokenizer's special tokens (``bos_token``, ...).
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "raise_exception", "strftime_now"}
)


def template_variables(
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a chat template sees: ``template_kwargs`` (vLLM's ``chat_template_kwargs``),
    then ``messages``, ``tools``, ``add_generation_prompt`` and the special tokens over
    them (the caller refuses kwargs naming those: `RESERVED_VARIABLES`)."""
    return {
        **(template_kwargs or {}),
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        **(special_tokens or {}),
    }


def render_messages(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render ``messages`` (dicts with ``role`` and ``content``; assistant messages may
    have ``tool_calls``, tool messages ``tool_call_id``) and the ``tools`` (OpenAI's
    definitions) to the prompt text with the server's own (trusted) template ``source``.
    ``template_kwargs`` are further variables the template sees (vLLM's
    ``chat_template_kwargs``, such as Qwen3's ``enable_thinking``); see
    `template_variables`. A template that came with a request is rendered by
    `trio_llm.text.template_guard.render_guarded` instead.

    Raises:
        TemplateError: the template rejected the conversation or failed to render (any
            error while rendering: it fails this request only; also when it recursed
            too deeply).
    """
    variables = template_variables(
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=special_tokens,
        tools=tools,
        template_kwargs=template_kwargs,
    )
    return render_template(source, variables)


def render_template(source: str, variables: dict[str, Any]) -> str:
    """`render_messages` with its `template_variables` made.

    Raises:
        TemplateError: as `render_messages`.
    """
    template = compile_template(source)
    try:
        return template.render(**variables)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"cannot apply the chat template: {exc}") from exc
    except RecursionError:  # a template's recursive macro over a deep value
        raise TemplateError(
            "cannot apply the chat template: the conversation nests too deeply for it"
        ) from None
    except Exception as exc:  # the template failed on this conversation: its 400
        problem = f"{type(exc).__name__}: {exc}"
        raise TemplateError(f"cannot apply the chat template: {problem}") from exc


def read_chat_template(
    value: str | os.PathLike[str] | None, name: str = "--chat-template"
) -> str | None:
    """The template text of ``--chat-template`` (or the ``chat_template`` argument of the
    embedding API): a file's contents, or the value itself when it is no file and looks
    like Jinja (``{{`` or ``{%``), as vLLM reads it. None stays None (the model's own).

    Raises:
        ValueError: ``name``: no such file, or the template is not valid Jinja.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif isinstance(value, str) and ("{{" in value or "{%" in value):
        template = value
    else:
        raise ValueError(f"{name}: no such file: {value}")
    try:
        compile_template(template)
    except TemplateError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    return template
