"""A chat template that arrives with a request (vLLM CVE-2026-115911's class): refused
unless the operator allows it (``--trust-request-chat-template``), and then rendered in
the guarded sandbox with caps on size and time (`trio_llm.text.template_guard`).

The hostile templates are rendered by `render_guarded` itself, then through the real app
(an engine played by the test) to show each gets its 400 naming ``chat_template`` and the
next request is served as before."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest

from tests.unit.conftest import ScriptedEngine, app_client
from trio_llm.messages import AddRequest
from trio_llm.server_config import RequestLimits
from trio_llm.text.chat_template import TemplateError
from trio_llm.text.template_guard import TemplateLimits, render_guarded

OWN = "{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}ASSISTANT:"
CHAT = [{"role": "user", "content": "hi"}]
VARIABLES = {"messages": CHAT, "tools": None, "add_generation_prompt": True}
LIMITS = TemplateLimits(timeout=0.5, max_chars=100_000)

#: Templates a hostile client might send, and what their refusal says.
HOSTILE = {
    "range loop": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "took longer than 0.5 s",
    ),
    "string multiplication": ("{{ 'a' * 10000000000 }}", "repeated value"),
    "number bomb": ("{% set n = 2 ** 100 %}{{ n ** 100000 }}", "number of more than"),
    "doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "more than 100000 characters",
    ),
    "macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too far"),
    "macro doubling": (
        "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
        "{{ f('ab', 60) }}",
        "more than 100000 characters",
    ),
    "captured block": (
        "{% macro m() %}{% for i in range(100000) %}{{ 'a' * 90000 }}{% endfor %}"
        "{% endmacro %}{{ m()|length }}",
        "a block of more than",
    ),
    "nested repeat": (
        "{% set a = ['x' * 1000] * 99 %}{% set b = [a] * 99 %}{{ [b] * 99 }}",
        "repeated value",
    ),
    "padding": ("{{ 'a'.ljust(1000000000) }}", "padded text"),
    "replace": ("{% set s = 'a' * 90000 %}{{ s.replace('a', s) }}", "replaced text"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "width past its cap"),
    "printf width": ("{{ '%999999999d' % 1 }}", "width past its cap"),
    "long output": ("{% for i in range(100000) %}{{ 'abc' }}{% endfor %}", "a text of more"),
    "class walk": ("{{ ().__class__.__base__.__subclasses__() }}", "not allowed"),
    "mutation": ("{% set l = [] %}{{ l.append(1) }}", "not allowed"),
    "error": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "bad jinja": ("{% for %}", "invalid chat template"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_stopped(name: str) -> None:
    source, says = HOSTILE[name]
    with pytest.raises(TemplateError, match=says.replace("(", r"\(")):
        render_guarded(source, dict(VARIABLES), LIMITS)


def test_a_template_within_the_caps_renders_as_jinja_does() -> None:
    source = (
        "{% for m in messages %}{{ m.role | upper }}={{ m.content | trim }};{% endfor %}"
        "{{ 'x' * 3 }}{{ '%s-%d' % ('a', 1) }}{{ '{}!'.format(2) }}{{ [1, 2] | join('+') }}"
        "{{ 'q' ~ 'r' }}{{ (tools or []) | tojson }}"
    )
    assert render_guarded(source, dict(VARIABLES), LIMITS) == "USER=hi;xxxa-12!1+2qr[]"


def test_tracing_is_off_after_a_render() -> None:
    import sys

    before = sys.gettrace()
    with pytest.raises(TemplateError):
        render_guarded(HOSTILE["range loop"][0], dict(VARIABLES), LIMITS)
    render_guarded(OWN, dict(VARIABLES), LIMITS)
    assert sys.gettrace() is before


# ---------------------------------------------------------------- through the app


async def _post(
    smol_tokenizer: Any, requests: list[tuple[str, dict[str, Any]]], **serving: Any
) -> tuple[list[httpx.Response], list[list[int]]]:
    """Each ``(path, body)`` posted in turn; the responses and the prompts that reached
    the engine."""
    engine = partial(ScriptedEngine, token_ids=[28])
    async with app_client(smol_tokenizer, engine, **serving) as (client, fake):
        responses = [await client.post(path, json=body) for path, body in requests]
    prompts = [m.prompt_token_ids for m in fake.received if isinstance(m, AddRequest)]
    return responses, prompts


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": CHAT, "max_tokens": 3, **fields}


def _assert_400(response: httpx.Response, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and says in error["message"], error
    assert "Traceback" not in response.text


async def test_a_request_template_is_refused_by_default(smol_tokenizer) -> None:
    """vLLM's default: without --trust-request-chat-template a request's template is a
    400 naming the field (on main it was silently ignored: the model's was used)."""
    responses, prompts = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat(chat_template=OWN)),
            ("/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": OWN})),
            ("/tokenize", {"model": "m", "messages": CHAT, "chat_template": OWN}),
            ("/v1/chat/completions", _chat()),
        ],
    )
    for response in responses[:3]:
        _assert_400(response, "--trust-request-chat-template")
    assert responses[3].status_code == 200
    expected = smol_tokenizer.encode(smol_tokenizer.render_chat(CHAT), add_special_tokens=False)
    assert prompts == [expected]  # only the last reached the engine, with the model's


async def test_a_trusted_request_template_is_used(smol_tokenizer) -> None:
    responses, prompts = await _post(
        smol_tokenizer,
        [
            ("/v1/chat/completions", _chat(chat_template=OWN)),
            ("/tokenize", {"model": "m", "messages": CHAT, "chat_template": OWN}),
        ],
        trust_request_chat_template=True,
    )
    assert [r.status_code for r in responses] == [200, 200]
    rendered = smol_tokenizer.encode("<<user: hi>>ASSISTANT:", add_special_tokens=False)
    assert prompts == [rendered]
    assert responses[1].json()["tokens"] == rendered


async def test_hostile_templates_fail_alone(smol_tokenizer) -> None:
    """Each hostile template gets its 400 naming chat_template; the request after them
    is served with the model's template, as if they never came."""
    limits = RequestLimits(max_request_chat_template_bytes=1024, request_chat_template_timeout=0.5)
    hostile = [source for name, (source, _says) in HOSTILE.items() if name != "error"]
    requests = [("/v1/chat/completions", _chat(chat_template=source)) for source in hostile]
    requests.append(("/v1/chat/completions", _chat(chat_template="{{ 'x' }}" * 200)))
    requests.append(("/v1/chat/completions", _chat()))
    responses, prompts = await _post(
        smol_tokenizer, requests, trust_request_chat_template=True, limits=limits
    )
    for response in responses[:-2]:
        _assert_400(response, "chat template")
    _assert_400(responses[-2], "limit of 1024 bytes")
    assert responses[-1].status_code == 200
    expected = smol_tokenizer.encode(smol_tokenizer.render_chat(CHAT), add_special_tokens=False)
    assert prompts == [expected]
