"""The ``tools`` of a Responses request (OpenAI's Responses API): which are offered to the
model as chat functions (``function`` tools, and the functions of ``namespace`` tools),
which are accepted and not offered (`HOSTED_TOOL_TYPES`), and how the names the model
knows map back to the client's (`OfferedTools`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from trio_llm.api.chat.request_body import Text
from trio_llm.api.http.errors import bad_request, validation_message

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


def offer_tools(tools: list[dict[str, Any]]) -> OfferedTools:
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
    functions = _functions(tools, offered.not_offered)
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


def _functions(
    tools: list[Any], not_offered: list[str], namespace: str | None = None, within: str = ""
) -> list[tuple[str, str | None, FunctionTool]]:
    """The functions of ``tools`` (a request's, or the namespace ``namespace``'s, which
    is at ``within``) as ``(place, namespace, function)``, in order; the types of the
    tools not offered are added to ``not_offered``, once each.

    Raises:
        APIError: as `offer_tools`.
    """
    functions: list[tuple[str, str | None, FunctionTool]] = []
    for i, tool in enumerate(tools):
        where = f"{within}tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append((where, namespace, _function(tool, where)))
        elif kind == "namespace" and namespace is None:
            name, inner = tool.get("name"), tool.get("tools")
            if not isinstance(name, str) or not name or not isinstance(inner, list):
                raise bad_request(
                    f"{where}: a namespace tool needs a name and a list of tools", "tools"
                )
            functions += _functions(inner, not_offered, name, f"{where}.")
        elif isinstance(kind, str) and kind in (
            HOSTED_TOOL_TYPES if namespace is None else ("custom",)
        ):
            if kind not in not_offered:
                not_offered.append(kind)
        elif namespace is None:
            raise bad_request(
                f"{where}: unknown tool type {kind!r} (function and namespace tools are "
                f"offered to the model; {', '.join(sorted(HOSTED_TOOL_TYPES))} are accepted "
                "and not offered)",
                "tools",
            )
        else:
            raise bad_request(
                f"{where}: a namespace holds function and custom tools, not {kind!r}", "tools"
            )
    return functions


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


class ConnectionWarnings:
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


#: The hosted-tool warnings of `ResponsesRequest.to_chat`, one per connection and types.
hosted_tool_warnings = ConnectionWarnings()
