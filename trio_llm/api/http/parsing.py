"""From a raw request body to a validated request, cheapest checks first.

A request's cost to the server must not grow with what it asks for before it is refused.
So the generation routes (HTTP and WebSocket) parse their bodies here rather than through
FastAPI's automatic validation, in this order:

1. the body size (`trio_llm.api.http.middleware.BodySizeLimitMiddleware`, before this module);
2. the content type, then JSON parsing;
3. `check_limits` on the raw JSON: counts and lengths only, of the fields the request
   model declares (its ``COUNTED_FIELDS``, a `CountedFields` in its API's names: number of
   prompts times samples, token-id prompt lengths against the context, messages, stop
   strings and their length), and how deep arrays and objects nest (`MAX_JSON_DEPTH`),
   each a 400 naming the field;
4. pydantic validation of every field.

Every later step that walks a JSON value recursively (pydantic, ``json.dumps`` of tool-call
arguments and schemas, the chat template's ``tojson``, the translations of other APIs'
requests into chat) thus sees at most `MAX_JSON_DEPTH` levels, far from Python's recursion
limit; JSON text inside a field (tool-call arguments, a schema given as a string) is held
to the same depth where it is decoded (`json_text_too_deep`). JSON nested too deeply
for Python's parser itself is refused the same way, naming the field (`load_json`).

Steps 2-4 run in a worker thread when the body is larger than `INLINE_PARSE_BYTES`, so a
large (valid or not) request never stalls the event loop that streams everyone else's
tokens. Later, costly work (chat templates, tokenizing) is also sized first, in
`trio_llm.api.chat.serving`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from trio_llm.api.http.errors import APIError, bad_request, invalid_request, validation_message
from trio_llm.errors import ContextLengthError
from trio_llm.server_config import RequestLimits

#: Bodies up to this size (bytes) are parsed and validated on the event loop (well under
#: a millisecond); larger ones in a worker thread.
INLINE_PARSE_BYTES = 16 * 1024

_Request = TypeVar("_Request", bound=BaseModel)

#: Deepest nesting of arrays and objects in a request body (the body is level 1), and in
#: JSON text inside one (tool-call arguments, a schema given as a string). serde_json's
#: default limit, which llguidance applies to every schema anyway; far beyond real requests
#: (OpenAI's structured outputs allow a schema 5 to 10 levels of objects) and far below Python's
#: recursion limit (1,000 frames), so every recursive walk of a value after the check
#: (pydantic, ``json.dumps``, a chat template's ``tojson`` or recursive macros) has room.
MAX_JSON_DEPTH = 128


_CONTAINERS = frozenset((dict, list))


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON: dicts, lists, scalars) nests arrays and objects
    more than ``limit`` levels deep (an array or object is level 1, a scalar level 0).

    Iterative, so any depth is safe to check. The cost grows with the number of elements,
    at C speed for arrays and objects of scalars (a long token-id prompt).
    """
    if type(value) not in _CONTAINERS:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if type(item) is dict else item
        if _CONTAINERS.isdisjoint(set(map(type, children))):
            continue
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def nested_too_deep(name: str | None) -> APIError:
    """The 400 for a value (of the field ``name``, when known) nested too deeply."""
    what = f"{name}: arrays and objects are" if name else "the request's arrays and objects are"
    return bad_request(
        f"{what} nested more than {MAX_JSON_DEPTH} levels deep, more than this server accepts",
        name,
    )


def json_text_too_deep(text: str) -> bool:
    """Whether ``text`` is JSON nesting arrays and objects more than `MAX_JSON_DEPTH`
    levels deep (False for text that is not JSON)."""
    try:
        return json_depth_exceeds(json.loads(text))
    except RecursionError:  # deeper than Python's parser goes
        return True
    except ValueError:
        return False


def check_json_text_depth(text: str) -> str:
    """``text`` unchanged, unless `json_text_too_deep` (a pydantic validator).

    Raises:
        ValueError: it nests too deeply (the message names no field).
    """
    if json_text_too_deep(text):
        raise ValueError(
            f"the JSON text's arrays and objects are nested more than {MAX_JSON_DEPTH} levels "
            "deep, more than this server accepts"
        )
    return text


@dataclass(frozen=True)
class CountedFields:
    """The fields of one API's request body that `check_limits` counts, in that API's
    names (each request model declares its own as ``COUNTED_FIELDS``); None: the body
    has no such field.

    Attributes:
        prompt: a prompt given as text, texts, token ids or a batch of token-id lists:
            the number of prompts times ``samples`` is held to ``--max-choices``, a
            token-id prompt to the context length.
        samples: the number of samples per prompt (``n``).
        messages: a list of turns, held to ``--max-chat-messages``.
        stop: a stop string or a list of them, held to ``--max-stop-strings`` and
            ``--max-stop-string-length``.
        per_token: lists or maps by token id, held to the vocabulary's size.
    """

    prompt: str | None = None
    samples: str | None = None
    messages: str | None = None
    stop: str | None = None
    per_token: tuple[str, ...] = ()


def check_limits(
    data: Any,
    limits: RequestLimits,
    *,
    max_model_len: int,
    vocab_size: int,
    fields: CountedFields,
) -> None:
    """Refuse a request whose size is out of bounds, looking only at counts and lengths
    of ``fields``, and at how deep its arrays and objects nest (`MAX_JSON_DEPTH`, any
    field).

    Runs before field validation; fields of the wrong type are left for it to report.

    Args:
        data: the parsed JSON body.
        limits: the server's `RequestLimits`.
        max_model_len: context length in tokens (a token-id prompt must be shorter).
        vocab_size: the ``fields.per_token`` cannot usefully hold more distinct entries
            than this.
        fields: the body's fields to count, in its API's names.

    Raises:
        APIError: 400 naming the field at fault.
    """
    if not isinstance(data, dict):
        return
    if fields.prompt is not None or fields.samples is not None:
        _check_choices(data, fields, limits, max_model_len)
    messages = data.get(fields.messages) if fields.messages else None
    if isinstance(messages, list) and len(messages) > limits.max_chat_messages:
        count = f"{len(messages)} {fields.messages}"
        raise _over(
            count, limits.max_chat_messages, " messages", "--max-chat-messages", fields.messages
        )
    if fields.stop is not None:
        _check_stop(data.get(fields.stop), fields.stop, limits)
    for name in fields.per_token:
        value = data.get(name)
        if isinstance(value, dict | list) and len(value) > vocab_size:
            raise bad_request(
                f"{name} has {len(value)} entries, more than the vocabulary's {vocab_size} tokens",
                name,
            )
    for name, value in data.items():  # the body itself is the first level
        if json_depth_exceeds(value, MAX_JSON_DEPTH - 1):
            raise nested_too_deep(name)


def _over(count: str, limit: int, unit: str, flag: str, param: str) -> APIError:
    """The 400 for ``count`` (a number and what it counts) over this server's ``limit``
    (of ``unit``, set by the option ``flag``)."""
    return bad_request(f"{count} is more than this server's limit of {limit}{unit} ({flag})", param)


def _check_choices(
    data: dict[str, Any], fields: CountedFields, limits: RequestLimits, max_model_len: int
) -> None:
    """Hold prompts times samples to ``--max-choices``, token-id prompts to the context."""
    num_prompts = 1
    prompt = data.get(fields.prompt) if fields.prompt else None
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], list):  # a batch of token-id prompts
            num_prompts = len(prompt)
            for item in prompt[: limits.max_choices]:
                _check_token_prompt(item, max_model_len)
        elif isinstance(prompt[0], str):  # a batch of text prompts
            num_prompts = len(prompt)
        else:  # one token-id prompt
            _check_token_prompt(prompt, max_model_len)
    n = data.get(fields.samples) if fields.samples else None
    n = n if isinstance(n, int) and n >= 1 else 1
    if num_prompts > limits.max_choices or num_prompts * n > limits.max_choices:
        param = fields.prompt if num_prompts > limits.max_choices else fields.samples
        count = f"{num_prompts} prompts x n={n}"
        unit = " choices per request"
        raise _over(count, limits.max_choices, unit, "--max-choices", param or "n")


def _check_stop(stop: Any, name: str, limits: RequestLimits) -> None:
    """Hold the stop strings ``stop`` (of the field ``name``) to the server's limits."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > limits.max_stop_strings:
        count = f"{len(stops)} stop strings"
        raise _over(count, limits.max_stop_strings, "", "--max-stop-strings", name)
    for item in stops:
        if isinstance(item, str) and len(item) > limits.max_stop_string_length:
            raise bad_request(
                f"a stop string of {len(item)} characters is longer than this server's limit "
                f"of {limits.max_stop_string_length} (--max-stop-string-length)",
                name,
            )


def _check_token_prompt(item: Any, max_model_len: int) -> None:
    if isinstance(item, list) and len(item) >= max_model_len:
        error = ContextLengthError(max_model_len, len(item), "prompt", prompt_name="prompt")
        raise invalid_request(error)


_NO_COUNTED_FIELDS = CountedFields()


def validate(
    model: type[_Request],
    data: Any,
    limits: RequestLimits,
    *,
    max_model_len: int,
    vocab_size: int,
) -> _Request:
    """`check_limits` of the fields ``model`` declares (its ``COUNTED_FIELDS``, a
    `CountedFields`; none counted without), then ``model``'s pydantic validation of
    ``data`` (parsed JSON).

    Raises:
        APIError: 400 naming the field at fault.
    """
    fields = getattr(model, "COUNTED_FIELDS", _NO_COUNTED_FIELDS)
    check_limits(data, limits, max_model_len=max_model_len, vocab_size=vocab_size, fields=fields)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(RequestValidationError(exc.errors()))
        raise bad_request(message, param) from exc


class JSONTooDeepError(ValueError):
    """JSON text that nests arrays and objects too deeply for Python's parser.

    Attributes:
        members: the members of the top-level object that come before the one too deep
            (empty when the text is not an object).
        field: the name of the member too deep, None if not found.
    """

    def __init__(self, members: dict[str, Any], field: str | None) -> None:
        super().__init__(f"JSON nested too deeply ({field or 'unknown field'})")
        self.members = members
        self.field = field


def load_json(text: bytes | str) -> Any:
    """``json.loads``, with JSON nested deeper than the parser goes (about 1,000 levels,
    less the caller's stack) told apart from invalid JSON.

    Raises:
        JSONTooDeepError: nested too deeply; it names the top-level member at fault.
        ValueError: not valid JSON (or not UTF-8).
    """
    try:
        return json.loads(text)
    except RecursionError:
        if isinstance(text, bytes):
            text = text.decode(json.detect_encoding(text), "surrogatepass")
        raise JSONTooDeepError(*_members_before_too_deep(text)) from None


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _members_before_too_deep(text: str) -> tuple[dict[str, Any], str | None]:
    """The top-level object's members up to the one the parser cannot reach the end of,
    and that member's name (None if none is found). One member at a time, so the cost is
    the parse's own."""
    members: dict[str, Any] = {}

    def skip(i: int) -> int:
        match = _WHITESPACE.match(text, i)  # always matches: the empty string too
        return match.end() if match is not None else i

    try:
        i = skip(0)
        if text[i] != "{":
            return members, None
        i = skip(i + 1)
        while text[i] == '"':
            key, i = _DECODER.raw_decode(text, i)
            i = skip(i)
            if text[i] != ":":
                break
            i = skip(i + 1)
            try:
                members[key], i = _DECODER.raw_decode(text, i)
            except RecursionError:
                return members, key
            i = skip(i)
            if text[i] != ",":
                break
            i = skip(i + 1)
    except (ValueError, IndexError):
        pass
    return members, None


def parse_json(body: bytes | str) -> Any:
    """The JSON value of ``body``.

    Raises:
        APIError: 400 when the body is not valid JSON (or not UTF-8), or nests too deeply
            for the parser (naming the field).
    """
    try:
        return load_json(body)
    except JSONTooDeepError as exc:
        raise nested_too_deep(exc.field) from None
    except ValueError as exc:
        raise bad_request("the request body is not valid JSON") from exc


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return True  # as FastAPI: no content type is read as JSON
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (
        main.startswith("application/") and main.endswith("+json")
    )


async def parse_body(
    model: type[_Request],
    body: bytes,
    content_type: str | None,
    limits: RequestLimits,
    *,
    max_model_len: int,
    vocab_size: int,
) -> _Request:
    """Parse and validate an HTTP request body as ``model`` (see the module docstring).

    Raises:
        APIError: 400 for a non-JSON content type, invalid JSON, a limit exceeded or an
            invalid field (naming it).
    """
    if not _is_json(content_type):
        raise bad_request(
            f"the request body must be JSON (Content-Type: application/json), not {content_type}"
        )

    def run() -> _Request:
        data = parse_json(body)
        return validate(model, data, limits, max_model_len=max_model_len, vocab_size=vocab_size)

    if len(body) <= INLINE_PARSE_BYTES:
        return run()
    return await trio.to_thread.run_sync(run)
