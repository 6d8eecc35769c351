"""``POST /v1/responses``: the stateless part of OpenAI's Responses API, as another output
format of chat.

A Responses request is translated into a `ChatCompletionRequest`
(`ResponsesRequest.to_chat`) and runs the one chat path; only the rendering differs
(`trio_llm.api.responses.format.ResponsesFormat`): a ``response`` object whose ``output``
holds a ``message`` item (``output_text``) and ``function_call`` items, and a stream of
typed events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` or ``response.incomplete``), each
with a ``sequence_number``.

Supported: ``input`` (a string, or message items with ``input_text`` / ``output_text``
parts, ``function_call`` and ``function_call_output`` items), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p`` (and vLLM's ``top_k``), ``text.format``
(``text``, ``json_object``, ``json_schema``), function ``tools`` and ``namespace`` tools
(their functions are offered to the model; a call of one comes back as a
``function_call`` item with the ``namespace`` and the function's own ``name``, as OpenAI
writes it), ``tool_choice``, ``parallel_tool_calls``, ``stream``, ``metadata``, ``user``.
Built-in tools that OpenAI runs itself (`trio_llm.api.responses.tools.HOSTED_TOOL_TYPES`:
``web_search``,
``file_search``, ``mcp``, ...) are accepted, echoed and not offered to the model (a
warning names them once per client connection). Fields that change nothing here
(``reasoning`` on a model without reasoning, ``include``, ``prompt_cache_key``,
``client_metadata``, ``service_tier``, ``safety_identifier``, ``truncation``,
``text.verbosity``, ``max_tool_calls``) are accepted and echoed. Non-text inputs and
``prompt`` are refused with a 400 naming the field.

Stored responses, ``previous_response_id``, ``conversation`` and ``background`` are
`trio_llm.api.responses.handlers`'s: it gives the request its earlier context
(`ResponsesRequest.continue_from`) and says whether it is stored
(`ResponsesRequest.stored`); the request reads its input as stored items
(`trio_llm.api.responses.items`), after that context.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt

from trio_llm.api.chat.request import ChatCompletionRequest
from trio_llm.api.chat.request_body import INT32_MAX, FiniteFloat, Priority, Text, check_json_text
from trio_llm.api.chat.translated import ChatTranslated, TokenCounter
from trio_llm.api.http.errors import APIError, bad_request
from trio_llm.api.http.parsing import CountedFields
from trio_llm.api.responses.items import context_items, stored_items
from trio_llm.api.responses.tools import OfferedTools, hosted_tool_warnings, offer_tools

logger = logging.getLogger(__name__)


class TextConfig(BaseModel):
    """``text``: ``{"format": {"type": "text" | "json_object" | "json_schema", ...},
    "verbosity": "low" | "medium" | "high"}`` (``verbosity`` is echoed and changes
    nothing here)."""

    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """``reasoning``: ``{"effort", "summary"}`` (OpenAI's values). Echoed in the
    response; on a model without reasoning it changes nothing."""

    model_config = ConfigDict(extra="allow")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


#: Fields refused unless absent, null or false (prompt templates are OpenAI's own).
_UNSUPPORTED = ("prompt",)

#: A chat tool's place in an error (``tools[2].function.``).
_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\.")

#: Input item types this server takes (messages, and the two halves of a tool call).
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class ResponsesRequest(ChatTranslated):
    """``POST /v1/responses`` (OpenAI's field names; see the module doc)."""

    ENDPOINT: ClassVar[str] = "/v1/responses"

    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\bmessages\b", "input"),
        (r"\bmax_tokens\b", "max_output_tokens"),
        (r"\bresponse_format\b", "text"),
        (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    )
    COUNTED_FIELDS: ClassVar[CountedFields] = CountedFields(messages="input")

    model: Text | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: FiniteFloat | None = Field(default=None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    stream: StrictBool = False
    store: StrictBool | None = None
    background: StrictBool | None = None
    previous_response_id: Text | None = None
    conversation: Text | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: Text | None = None
    priority: Priority = 0
    # Accepted; what each does here is in docs/api.md (mostly: echoed, nothing else).
    reasoning: ReasoningConfig | None = None
    include: list[Text] | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    client_metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)

    _connection: Any = PrivateAttr(default=None)
    _offered: OfferedTools | None = PrivateAttr(default=None)
    _context: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _items: list[dict[str, Any]] | None = PrivateAttr(default=None)
    _stored: bool = PrivateAttr(default=False)

    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as stored items, each with an ``id`` (made once per request)."""
        if self._items is None:
            self._items = stored_items(self.input)
        return self._items

    @property
    def context(self) -> list[dict[str, Any]]:
        """The earlier items this request continues (`continue_from`), oldest first."""
        return self._context

    @property
    def stored(self) -> bool:
        """Whether the response is stored (``store`` as the server resolved it)."""
        return self._stored

    def continue_from(
        self,
        context: list[dict[str, Any]],
        items: list[dict[str, Any]] | None = None,
        *,
        stored: bool,
    ) -> None:
        """Put ``context`` (stored items of a previous response or a conversation) before
        the input, say whether the response is ``stored``, and take ``items`` (the input
        as stored before) when running a stored request again."""
        self._context = context
        self._stored = stored
        if items is not None:
            self._items = items

    @property
    def conversation_id(self) -> str | None:
        """The ``conversation`` field's id (a string, or ``{"id": ...}``), or None.

        Raises:
            APIError: 400 naming ``conversation`` for another shape.
        """
        given = self.conversation
        if isinstance(given, dict):
            given = given.get("id")
            if not isinstance(given, str):
                message = 'conversation must be an id or {"id": "conv_..."}'
                raise bad_request(message, "conversation")
        return given

    def bind_connection(self, client: Any) -> None:
        """Name the client connection the request came on (the ASGI ``client``,
        ``(host, port)``), for the once-per-connection warning about tools not offered."""
        self._connection = client

    @property
    def offered_tools(self) -> OfferedTools:
        """The tools offered to the model (see `OfferedTools`).

        Raises:
            APIError: 400 naming ``tools`` for a tool this server cannot read.
        """
        if self._offered is None:
            self._offered = offer_tools(self.tools or [])
        return self._offered

    def _check_supported(self) -> None:
        extra = self.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name) is not None and extra.get(name) is not False:
                raise bad_request(f"`{name}` is not supported by this server", name)
        # Echoed in the response as given: they must be valid Unicode to the last key.
        echoed = {"metadata": self.metadata, "tools": self.tools, "text": self.text}
        echoed["tool_choice"] = self.tool_choice
        echoed["reasoning"] = self.reasoning
        for name, value in echoed.items():
            if value is not None:
                dumped = value.model_dump() if isinstance(value, BaseModel) else value
                check_json_text(dumped, name)
        calls = any(
            isinstance(item, dict) and item.get("type") in ("function_call", "function_call_output")
            for item in (*self._context, *self.items)
        )
        if calls and not self.tools:
            where = "input" if not self._context else "the input or the context it continues"
            raise bad_request(
                f"{where} has function_call or function_call_output items: send the tools "
                "the calls used in `tools` (the chat template shows calls only with their tools)",
                "tools",
            )

    def api_names(self, param: str | None, message: str) -> tuple[str | None, str]:
        """As `ChatTranslated.api_names`; a chat tool's place is the Responses tool's
        (a namespace's function is ``tools[i].tools[j]``)."""
        if self._offered is not None:
            places = self._offered.chat_where

            def place(match: re.Match[str]) -> str:
                k = int(match.group(1))
                return (places[k] if k < len(places) else f"tools[{k}]") + "."

            message = _CHAT_TOOL.sub(place, message)
            if param is not None:
                param = _CHAT_TOOL.sub(place, param)
        return super().api_names(param, message)

    def thinking_requested(self) -> bool | None:
        """``reasoning.effort`` ``"none"`` is False, any other effort True."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return None
        return effort != "none"

    def to_chat(self, count_tokens: TokenCounter | None = None) -> ChatCompletionRequest:
        """The chat-completion request this Responses request asks for (``count_tokens``:
        not needed here).

        Raises:
            APIError: a 400 naming the Responses field at fault.
        """
        self._check_supported()
        offered = self.offered_tools
        if offered.not_offered:
            self._warn_not_offered(tuple(offered.not_offered))
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for k, item in enumerate(context_items(self._context)):
            _add_item(messages, item, f"context item {k} ({item.get('id')})", offered)
        for i, item in enumerate(self.items):
            _add_item(messages, item, f"input[{i}]", offered)
        if not messages:
            raise bad_request("input must hold at least one message", "input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "priority": self.priority,
        }
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        if offered.chat_tools:
            body["tools"] = offered.chat_tools
        body.update(self._tool_choice(offered))
        return self.validated_chat(body, "input")

    def _warn_not_offered(self, types: tuple[str, ...]) -> None:
        """Log the tool types not offered to the model, once per client connection."""
        if hosted_tool_warnings.first(self._connection, types):
            logger.warning(
                "/v1/responses: tools of type %s are not offered to the model (this "
                "server cannot run them); client %s",
                ", ".join(types),
                _client_text(self._connection),
            )

    def _tool_choice(self, offered: OfferedTools) -> dict[str, Any]:
        """The chat ``tool_choice`` of this request's (none: the chat default)."""
        if isinstance(self.tool_choice, dict):
            choice = self.tool_choice
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", '
                    '"name": ...}',
                    "tool_choice",
                )
            namespace = choice.get("namespace")
            if not isinstance(namespace, str):
                namespace = None
            name = offered.model_name(namespace, choice["name"])
            return {"tool_choice": {"type": "function", "function": {"name": name}}}
        if self.tool_choice == "required" and self.tools and not offered.chat_tools:
            why = (
                f"tools of type {', '.join(offered.not_offered)} are not offered to the model here"
                if offered.not_offered
                else "the namespaces given hold no functions"
            )
            raise bad_request(f'tool_choice "required" needs a function tool: {why}', "tool_choice")
        if self.tool_choice is not None and (offered.chat_tools or not self.tools):
            # "auto" or "none" with only hosted tools: no tools, plain text.
            return {"tool_choice": self.tool_choice}
        return {}

    def _response_format(self) -> dict[str, Any] | None:
        form = self.text.format if self.text is not None else None
        if form is None or form.get("type") == "text":
            return None
        if form.get("type") == "json_object":
            return {"type": "json_object"}
        if form.get("type") == "json_schema" and isinstance(form.get("name"), str):
            schema = {"name": form["name"], "schema": form.get("schema", {})}
            schema["strict"] = form.get("strict") is True
            return {"type": "json_schema", "json_schema": schema}
        raise bad_request(
            "text.format must be {type: text}, {type: json_object} or {type: json_schema, "
            "name, schema, strict}",
            "text",
        )


def _text(content: Any, where: str) -> str:
    """A message item's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise bad_request(
                f"{where}: content parts of type {kind!r} are not supported: the model served "
                "here takes text only (input_text parts)",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def check_items(items: list[dict[str, Any]], param: str) -> None:
    """Refuse an item the chat path could not read as a later response's context (the
    checks of a request's input items; reasoning items are kept, and never shown to the
    model), or text that is not valid Unicode.

    Raises:
        APIError: 400 naming ``param`` (the item's place in the message).
    """
    check_json_text(items, param)
    messages: list[dict[str, Any]] = []
    offered = offer_tools([])
    for i, item in enumerate(items):
        if item.get("type") == "reasoning":
            continue
        try:
            _add_item(messages, item, f"{param}[{i}]", offered)
        except APIError as exc:
            exc.param = param
            raise


def _add_item(
    messages: list[dict[str, Any]], item: dict[str, Any], where: str, offered: OfferedTools
) -> None:
    """Append one input item (at ``where``, for errors) to the chat ``messages`` (a
    function call joins the assistant message before it, as a chat turn holds all its
    calls; a call of a namespace's function gets the name the model knows it by)."""
    kind = item.get("type", "message")
    if kind not in _ITEM_TYPES:
        raise bad_request(f"{where}: items of type {kind!r} are not supported", "input")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"{where}.role must be user, system, developer or assistant", "input")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
        return
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.call_id must be a string", "input")
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, where)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        return
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"{where}: a function_call needs a name and arguments", "input")
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise bad_request(f"{where}.namespace must be a string", "input")
    name = offered.model_name(namespace, name)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant":
        last["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _client_text(client: Any) -> str:
    """A client address for a log line: ``host:port``, or ``unknown``."""
    if isinstance(client, tuple) and len(client) == 2:
        return f"{client[0]}:{client[1]}"
    return "unknown"
