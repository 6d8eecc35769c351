"""``POST /v1/responses``: the stateless part of OpenAI's Responses API, as another output
format of chat.

A Responses request is translated into a `ChatCompletionRequest`
(`ResponsesRequest.to_chat`) and runs the one chat path; only the rendering differs
(`ResponsesFormat`): a ``response`` object whose ``output`` holds a ``message`` item
(``output_text``) and ``function_call`` items, and a stream of typed events
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
Built-in tools that OpenAI runs itself (`HOSTED_TOOL_TYPES`: ``web_search``,
``file_search``, ``mcp``, ...) are accepted, echoed and not offered to the model (a
warning names them once per client connection). Fields that change nothing here
(``reasoning`` on a model without reasoning, ``include``, ``prompt_cache_key``,
``client_metadata``, ``service_tier``, ``safety_identifier``, ``truncation``,
``text.verbosity``, ``max_tool_calls``) are accepted and echoed. Nothing is stored:
``store: true``, ``previous_response_id``, ``conversation`` and ``background`` are
refused with a 400 naming the field, as are non-text inputs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
)

from trio_llm.api.errors import APIError, bad_request, validation_message
from trio_llm.api.formats import Block, BlockFormat
from trio_llm.api.protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    ChatTranslated,
    FiniteFloat,
    Text,
    check_json_text,
)
from trio_llm.api.response_format import Event
from trio_llm.text.choice import Choice

if TYPE_CHECKING:
    from trio_llm.api.response_format import Plan

logger = logging.getLogger(__name__)

#: Tool types OpenAI runs on its side (or that the model emits as their own output items):
#: accepted, echoed in the response's ``tools``, and not offered to the model here.
#: ``custom`` (free-form text input, maybe held to a grammar) is among them: its calls
#: are ``custom_tool_call`` items, which this server does not write.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
        "programmatic_tool_calling",
        "custom",
    }
)


class FunctionTool(BaseModel):
    """``{"type": "function", "name", "description", "parameters", "strict"}``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


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


@dataclass
class OfferedTools:
    """What a request's ``tools`` offer the model, and how its calls map back.

    Attributes:
        chat_tools: the chat-completion ``tools`` (function tools; a namespace's
            functions flattened among them).
        client_names: each offered function's name as the model sees it -> the
            ``(namespace, name)`` the client knows it by (namespace None for a plain
            function tool).
        model_names: the reverse of ``client_names``.
        chat_where: the Responses place (``tools[4].tools[0]``) of each chat tool.
        not_offered: the types of the tools not offered (hosted ones), in order, once.
    """

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    client_names: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    model_names: dict[tuple[str | None, str], str] = field(default_factory=dict)
    chat_where: list[str] = field(default_factory=list)
    not_offered: list[str] = field(default_factory=list)

    def model_name(self, namespace: str | None, name: str) -> str:
        """The name the model knows the client's function ``(namespace, name)`` by: a
        function without a namespace may also be named by its own name when one
        namespace's function has it; else ``name`` as is."""
        if (namespace, name) in self.model_names:
            return self.model_names[namespace, name]
        if namespace is None:
            matches = [flat for (_, own), flat in self.model_names.items() if own == name]
            if len(matches) == 1:
                return matches[0]
        return name


class _ConnectionWarnings:
    """Remembers which (client connection, tool types) pairs were warned about, so that
    a client sending the same hosted tools on every request of a connection gets one
    warning line; at most `limit` pairs (the oldest are forgotten first)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._seen: OrderedDict[tuple[Any, tuple[str, ...]], None] = OrderedDict()
        self._lock = threading.Lock()  # `to_chat` runs in worker threads

    def first(self, connection: Any, types: tuple[str, ...]) -> bool:
        """True the first time ``(connection, types)`` is seen."""
        key = (connection, types)
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            if len(self._seen) > self.limit:
                self._seen.popitem(last=False)
            return True


_warnings = _ConnectionWarnings()


#: Fields of a stateful or background response; refused unless absent, null or false.
_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")

#: A chat tool's place in an error (``tools[2].function.``).
_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\.")

#: Input item types this server takes (messages, and the two halves of a tool call).
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class ResponsesRequest(ChatTranslated):
    """``POST /v1/responses`` (OpenAI's field names; see the module doc)."""

    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"\bmessages\b", "input"),
        (r"\bmax_tokens\b", "max_output_tokens"),
        (r"\bresponse_format\b", "text"),
        (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    )

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
    metadata: dict[str, Any] | None = None
    user: Text | None = None
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
            self._offered = _offer(self.tools or [])
        return self._offered

    def _check_supported(self) -> None:
        if self.store:
            raise bad_request(
                "store: true is not supported: this server keeps no responses (send "
                "store: false, and the whole conversation as input)",
                "store",
            )
        extra = self.model_extra or {}
        for name in _STATEFUL:
            if extra.get(name) is not None and extra.get(name) is not False:
                raise bad_request(
                    f"`{name}` is not supported: this server keeps no responses or "
                    "conversations (send the whole conversation as input)",
                    name,
                )
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
            for item in (self.input if isinstance(self.input, list) else ())
        )
        if calls and not self.tools:
            raise bad_request(
                "input with function_call or function_call_output items needs the tools the "
                "calls used in `tools` (the chat template shows calls only with their tools)",
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

    def to_chat(self) -> ChatCompletionRequest:
        """The chat-completion request this Responses request asks for.

        Raises:
            APIError: a 400 naming the Responses field at fault.
        """
        self._check_supported()
        offered = self.offered_tools
        if offered.not_offered:
            types = tuple(offered.not_offered)
            if _warnings.first(self._connection, types):
                logger.warning(
                    "/v1/responses: tools of type %s are not offered to the model (this "
                    "server cannot run them); client %s",
                    ", ".join(types),
                    _client_text(self._connection),
                )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for i, item in enumerate(self.input):
                _add_item(messages, item, i, offered)
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
        }
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        if offered.chat_tools:
            body["tools"] = offered.chat_tools
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
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif self.tool_choice == "required" and self.tools and not offered.chat_tools:
            why = (
                f"tools of type {', '.join(offered.not_offered)} are not offered to the model here"
                if offered.not_offered
                else "the namespaces given hold no functions"
            )
            raise bad_request(f'tool_choice "required" needs a function tool: {why}', "tool_choice")
        elif self.tool_choice is not None and (offered.chat_tools or not self.tools):
            # "auto" or "none" with only hosted tools: no tools, plain text.
            body["tool_choice"] = self.tool_choice
        return self.validated_chat(body, "input")

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


def _add_item(
    messages: list[dict[str, Any]], item: dict[str, Any], i: int, offered: OfferedTools
) -> None:
    """Append one input item to the chat ``messages`` (a function call joins the
    assistant message before it, as a chat turn holds all its calls; a call of a
    namespace's function gets the name the model knows it by)."""
    where = f"input[{i}]"
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


def _offer(tools: list[dict[str, Any]]) -> OfferedTools:
    """The `OfferedTools` of a request's ``tools``.

    A namespace's function is offered under its own name when no other offered function
    has that name, else as ``<namespace>__<name>`` (the namespace's trailing
    underscores dropped first: ``mcp__fs__`` + ``read`` is ``mcp__fs__read``).

    Raises:
        APIError: 400 naming ``tools`` (the message says which) for a tool that is not a
            dict, a type this server does not know, an invalid function or namespace, or
            two functions the model would know by one name.
    """
    offered = OfferedTools()
    functions: list[tuple[str, str | None, FunctionTool]] = []  # (where, namespace, tool)

    def not_offered(kind: str) -> None:
        if kind not in offered.not_offered:
            offered.not_offered.append(kind)

    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append((where, None, _function(tool, where)))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
                raise bad_request(
                    f"{where}: a namespace tool needs a name and a list of tools", "tools"
                )
            for j, member in enumerate(inner):
                member_where = f"{where}.tools[{j}]"
                member_kind = member.get("type") if isinstance(member, dict) else None
                if member_kind == "function":
                    functions.append((member_where, namespace, _function(member, member_where)))
                elif member_kind == "custom":
                    not_offered("custom")
                else:
                    raise bad_request(
                        f"{member_where}: a namespace holds function and custom tools, not "
                        f"{member_kind!r}",
                        "tools",
                    )
        elif kind in HOSTED_TOOL_TYPES:
            not_offered(kind)
        else:
            raise bad_request(
                f"{where}: unknown tool type {kind!r} (function and namespace tools are "
                f"offered to the model; {', '.join(sorted(HOSTED_TOOL_TYPES))} are accepted "
                "and not offered)",
                "tools",
            )
    own_names: dict[str, int] = {}
    for _, _, function in functions:
        own_names[function.name] = own_names.get(function.name, 0) + 1
    for where, namespace, function in functions:
        model_name = function.name
        if namespace is not None and own_names[function.name] > 1:
            model_name = f"{namespace.rstrip('_')}__{function.name}"
        if model_name in offered.client_names:
            raise bad_request(f"{where}: two tools have the function name {model_name!r}", "tools")
        offered.client_names[model_name] = (namespace, function.name)
        offered.model_names[namespace, function.name] = model_name
        offered.chat_tools.append(_chat_tool(function, model_name))
        offered.chat_where.append(where)
    return offered


def _function(tool: dict[str, Any], where: str) -> FunctionTool:
    try:
        return FunctionTool.model_validate(tool)
    except ValidationError as exc:
        message, _ = validation_message(RequestValidationError(exc.errors()))
        raise bad_request(f"{where}: {message}", "tools") from exc


def _chat_tool(function: FunctionTool, name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": function.description,
            "parameters": function.parameters,
            "strict": function.strict,
        },
    }


class ResponsesFormat(BlockFormat):
    """Renders a chat response as a Responses API ``response`` (see the module doc).

    Args:
        request: the Responses request, echoed in the response (``instructions``,
            ``tools``, ``text``, sampling fields), as OpenAI does.
    """

    id_prefix = "resp"
    object = "response"
    done_marker = None

    def __init__(self, *args: Any, request: ResponsesRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request = request
        self._sequence = 0
        self._item_ids: dict[int, str] = {}
        self._done_items: list[dict[str, Any]] = []

    def new_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    def _item_id(self, block: Block) -> str:
        if block.index not in self._item_ids:
            prefix = {"text": "msg", "call": "fc", "thinking": "rs"}[block.kind]
            self._item_ids[block.index] = f"{prefix}_{uuid.uuid4().hex}"
        return self._item_ids[block.index]

    def _item(self, block: Block, status: str) -> dict[str, Any]:
        if block.kind == "thinking":  # a reasoning item, its text whole (no summary)
            content = [] if status == "in_progress" else [self._reasoning_part(block.text)]
            return {
                "type": "reasoning",
                "id": self._item_id(block),
                "summary": [],
                "content": content,
                "status": status,
            }
        if block.kind == "call":
            item = {
                "type": "function_call",
                "id": self._item_id(block),
                "call_id": block.call_id,
                "name": block.name,
                "arguments": "" if status == "in_progress" else block.text,
                "status": status,
            }
            # A namespace's function: its namespace and own name, as the client knows it.
            namespace, name = self.request.offered_tools.client_names.get(
                block.name or "", (None, block.name)
            )
            if namespace is not None:
                item["name"], item["namespace"] = name, namespace
            return item
        parts = [] if status == "in_progress" else [self._part(block.text)]
        return {
            "type": "message",
            "id": self._item_id(block),
            "status": status,
            "role": "assistant",
            "content": parts,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _reasoning_part(text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text}

    def _response(
        self,
        plan: Plan,
        status: str,
        output: list[dict[str, Any]],
        choice: Choice | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        request = self.request
        incomplete = None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        usage = None
        if choice is not None:
            prompt = sum(plan.prompt_lengths)
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": choice.num_cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": choice.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + choice.num_output_tokens,
            }
        reasoning = request.reasoning or ReasoningConfig()
        text: dict[str, Any] = {
            "format": (request.text.format if request.text else None) or {"type": "text"},
            "verbosity": (request.text.verbosity if request.text else None) or "medium",
        }
        # Fields in the order of OpenAI's Response object.
        return {
            "id": plan.response_id,
            "object": "response",
            "created_at": plan.created or int(time.time()),
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "model": plan.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "prompt_cache_key": request.prompt_cache_key,
            "prompt_cache_retention": request.prompt_cache_retention,
            "reasoning": {
                "effort": reasoning.effort,
                "summary": reasoning.summary or reasoning.generate_summary,
            },
            "safety_identifier": request.safety_identifier,
            "service_tier": "default",
            "store": False,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": text,
            # OpenAI's default, echoed with or without tools.
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_logprobs": 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def response(self, plan: Plan, choices: list[Choice]) -> dict[str, Any]:
        (choice,) = choices
        blocks, finish_reason = self.blocks(plan, choice)
        output = [self._item(block, "completed") for block in blocks]
        if output and finish_reason == "length":  # the last item was cut off
            output[-1]["status"] = "incomplete"
        return self._response(plan, "completed", output, choice, finish_reason)

    def _event(self, kind: str, **fields: Any) -> Event:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return (kind, data)

    def stream_start(self, plan: Plan, choices: list[Choice]) -> list[Event]:
        response = self._response(plan, "in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def block_started(self, plan: Plan, block: Block) -> list[Event]:
        events = [
            self._event(
                "response.output_item.added",
                output_index=block.index,
                item=self._item(block, "in_progress"),
            )
        ]
        if block.kind != "call":
            part = self._part("") if block.kind == "text" else self._reasoning_part("")
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._item_id(block),
                    output_index=block.index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def block_delta(self, plan: Plan, block: Block, text: str) -> list[Event]:
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if block.kind == "call":
            return [self._event("response.function_call_arguments.delta", **where, delta=text)]
        if block.kind == "thinking":
            return [
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            ]
        return [
            self._event(
                "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
            )
        ]

    def block_stopped(self, plan: Plan, block: Block) -> list[Event]:
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if block.kind == "call":
            events = [
                self._event("response.function_call_arguments.done", **where, arguments=block.text)
            ]
        elif block.kind == "thinking":
            events = [
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=block.text
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=self._reasoning_part(block.text),
                ),
            ]
        else:
            events = [
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=block.text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    **where,
                    content_index=0,
                    part=self._part(block.text),
                ),
            ]
        item = self._item(block, "incomplete" if self.finish_reason == "length" else "completed")
        events.append(self._event("response.output_item.done", output_index=block.index, item=item))
        self._done_items.append(item)
        return events

    def message_finished(self, plan: Plan, choice: Choice, finish_reason: str) -> list[Event]:
        response = self._response(plan, "completed", self._done_items, choice, finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]

    def stream_end(self, plan: Plan, choices: list[Choice], *, include_usage: bool) -> list[Event]:
        return []

    def stream_failed(self, plan: Plan, error: APIError) -> list[Event]:
        """The whole stream of a response that failed before any output: created,
        in progress, then ``response.failed`` with ``error`` (its ``code`` and
        ``message``): how OpenAI streams a context overflow, and where Codex looks for
        ``context_length_exceeded``."""
        events = self.stream_start(plan, [])
        response = self._response(plan, "failed", [])
        response["error"] = {"code": error.code, "message": error.message}
        return [*events, self._event("response.failed", response=response)]

    def stream_error(self, error: APIError) -> Event:
        return self._event("error", code=error.code, message=error.message, param=error.param)
