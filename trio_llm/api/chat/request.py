"""The body of ``POST /v1/chat/completions``: messages, tools and the tool choice.

`ChatCompletionRequest` adds to the shared `GenerationRequest` fields the chat fields, and
checks the tools' schemas with the output constraint (a forced tool call is held to its
function's schema; tools with a response format to `calls_or_answer_grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr, StrictBool, StrictInt

from trio_llm.api.chat.generation_request import GenerationRequest
from trio_llm.api.chat.messages import ChatMessage
from trio_llm.api.chat.request_body import INT32_MAX, DescribedTool, Text
from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.parsing import CountedFields
from trio_llm.api.tools.grammar import EMPTY_PARAMETERS, calls_or_answer_grammar, tool_call_grammar
from trio_llm.messages import StructuredOutput
from trio_llm.structured_output.schema_rewrites import close_object_schemas
from trio_llm.structured_output.spec_limits import MAX_SCHEMA_CHARS
from trio_llm.text.chat_template import RESERVED_VARIABLES

#: Most ``tools`` in one request (OpenAI's limit); each one's schema is checked.
MAX_TOOLS = 128

#: A function name as OpenAI allows it.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(DescribedTool):
    """A tool's function: ``name``, ``description``, ``parameters`` (a JSON Schema of
    the arguments object) and ``strict`` (calls are always held to the schema here)."""

    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    """The function a named ``tool_choice`` forces."""

    name: Text


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


@dataclass
class TranslatedAsks:
    """What a request of another API asks of the chat path beyond chat's own fields (set
    by its `ChatTranslated.to_chat`; a plain chat completion asks none of it).

    Attributes:
        fold_late_system: system messages after the first message are folded into the
            leading system prompt when the chat template cannot show a system message at
            their place (Anthropic's ``role: "system"`` turns in ``messages``).
        thinking: Anthropic's ``thinking`` as sent (``{"type": "enabled", "budget_tokens":
            N}``, ``{"type": "adaptive"}``, ``{"type": "disabled"}``), for the reasoning
            support; None when not given. Inert on a model without reasoning.
        effort: Anthropic's ``output_config.effort`` (``low`` ... ``max``), likewise.
    """

    fold_late_system: bool = False
    thinking: dict[str, Any] | None = None
    effort: str | None = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    COUNTED_FIELDS: ClassVar[CountedFields] = dataclasses.replace(
        GenerationRequest.COUNTED_FIELDS, messages="messages"
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    #: vLLM's: leave the final (assistant) message open, so the output continues it.
    continue_final_message: StrictBool = False
    #: vLLM's: further variables for the chat template, such as Qwen3's
    #: ``{"enable_thinking": false}`` (`template_kwargs`).
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the request's own chat template, used with --trust-request-chat-template
    #: only (`request_chat_template`).
    chat_template: Text | None = None

    @property
    def request_chat_template(self) -> str | None:
        """The template the request brings: ``chat_template``, else a string under
        ``chat_template_kwargs.chat_template`` (vLLM reads both); None for the model's."""
        if self.chat_template is not None:
            return self.chat_template
        given = (self.chat_template_kwargs or {}).get("chat_template")
        return given if isinstance(given, str) else None

    def template_kwargs(self, special_tokens: Iterable[str] = ()) -> dict[str, Any] | None:
        """``chat_template_kwargs`` as the template sees them (None when not given).

        Raises:
            APIError: a 400 naming ``chat_template_kwargs`` for a variable the server
                sets itself (``messages``, ``tools``, ``add_generation_prompt``, the
                tokenizer's ``special_tokens`` such as ``bos_token``, ...).
        """
        kwargs = self.chat_template_kwargs
        if not kwargs:
            return None
        reserved = sorted(set(kwargs) & (RESERVED_VARIABLES | set(special_tokens)))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {reserved}: the server gives the template "
                "these itself (messages and tools are request fields)",
                "chat_template_kwargs",
            )
        return dict(kwargs)

    _translated: TranslatedAsks = PrivateAttr(default_factory=TranslatedAsks)

    @property
    def translated(self) -> TranslatedAsks:
        """What the translated request this one came from asks beyond chat's fields."""
        return self._translated

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them."""
        return [message.template_message() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template sees them (None without tools)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def effective_tool_choice(self) -> str:
        """``none``, ``auto``, ``required`` or ``function`` (a named one, see
        `forced_function`); OpenAI's default: ``auto`` with tools, ``none`` without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forced_function(self) -> str | None:
        """The function a named tool_choice forces, else None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    @property
    def forces_tool_call(self) -> bool:
        """Whether the output is constrained to a tool call (required or named)."""
        return self.effective_tool_choice in ("required", "function")

    @property
    def asks_for_structured_output(self) -> bool:
        """As `GenerationRequest.asks_for_structured_output`; tools count (their
        schemas are checked)."""
        return bool(self.tools) or super().asks_for_structured_output

    @property
    def held_calls_or_answer(self) -> bool:
        """Whether the output is held to `calls_or_answer_grammar` (tools with
        ``tool_choice: "auto"`` and a response format, on a server that serves "auto"),
        once `structured_output` ran."""
        return bool(
            self._structured_output is not None
            and self.tools
            and self.effective_tool_choice == "auto"
            and self._tool_call_parser is not None
        )

    def _check_structured_output(self) -> StructuredOutput | None:
        spec = super()._check_structured_output()
        functions = self._check_tools()
        choice = self.effective_tool_choice
        if self.forces_tool_call:
            # The call's schema applies; a response format is for answers, and a forced
            # call is no answer (OpenAI's and vLLM's reading).
            self._structured_param = "tools"
            grammar = tool_call_grammar(functions, self.forced_function, self.parallel_tool_calls)
            if self.forced_function is None:  # (a named one is the function's own schema)
                self._grammar_checks.append((grammar, "tools", "tools"))
            return grammar
        if spec is None or choice == "none":
            return spec
        param = self._structured_param or "response_format"
        if spec.kind not in ("json", "json_object"):
            raise bad_request(
                f"{param}: only a JSON format (a JSON Schema or a JSON object) can be combined "
                'with tools (unless tool_choice is "none")',
                param,
            )
        if self._tool_call_parser is None:
            return None  # "auto" is refused by the server (no --tool-call-parser)
        grammar = calls_or_answer_grammar(
            functions, spec, self._tool_call_parser, self.parallel_tool_calls
        )
        self._grammar_checks.append((grammar, param, param))
        return grammar

    def _check_tools(self) -> dict[str, dict[str, Any]]:
        """Each function's name and parameters schema, checked.

        Raises:
            APIError: a 400 naming ``tools`` (a bad name, a repeated name, a schema that
                cannot be enforced, matches nothing or is over this server's limits) or
                ``tool_choice`` (no tools, an unknown function).
        """
        functions: dict[str, dict[str, Any]] = {}
        total = 0  # characters of all the schemas
        for i, tool in enumerate(self.tools or ()):
            function = tool.function
            if not _FUNCTION_NAME.fullmatch(function.name):
                raise bad_request(
                    f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores "
                    f"or dashes, got {function.name!r}",
                    "tools",
                )
            if function.name in functions:
                raise bad_request(
                    f"tools: the function name {function.name!r} is repeated", "tools"
                )
            schema = EMPTY_PARAMETERS if function.parameters is None else function.parameters
            where = f"tools[{i}].function.parameters ({function.name})"
            if schema.get("type", "object") != "object":
                raise bad_request(
                    f'{where} must be a JSON Schema of type "object" (the arguments are an '
                    f"object), got {schema['type']!r}",
                    "tools",
                )
            if self._close_schemas or function.strict:
                schema = close_object_schemas(schema)
            spec = StructuredOutput("json", json.dumps(schema))
            total += len(spec.spec)
            self._check_spec(spec, where, "tools")
            functions[function.name] = schema
        if total > MAX_SCHEMA_CHARS:
            raise bad_request(
                f"tools: the functions' parameters schemas have {total:,} characters in all, "
                f"more than this server's limit of {MAX_SCHEMA_CHARS:,}",
                "tools",
            )
        name = self.forced_function
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        if name is not None and name not in functions:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({sorted(functions)})",
                "tool_choice",
            )
        return functions
