"""Request bodies of the OpenAI-compatible routes, validated by pydantic.

Field names and defaults follow the OpenAI API reference; ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output`` and ``skip_special_tokens`` are vLLM's extensions. Fields
that OpenAI or vLLM define but this server does not implement are accepted only at their
neutral value, so a client never silently gets something other than what it asked for;
unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from trio_llm.api.errors import bad_request, validation_message
from trio_llm.api.parsing import check_json_text_depth, json_text_too_deep, nested_too_deep
from trio_llm.api.tool_grammar import EMPTY_PARAMETERS, calls_or_answer_grammar, tool_call_grammar
from trio_llm.engine.spec_checks import MAX_SCHEMA_CHARS, check_spec_limits, close_object_schemas
from trio_llm.engine.structured import StructuredOutputError, check_structured_output
from trio_llm.messages import MIN_REPETITION_PENALTY, SamplingParams, StructuredOutput
from trio_llm.text.chat_template import RESERVED_VARIABLES

#: Largest integer accepted where the engine takes a 64-bit or 32-bit value.
INT32_MAX = 2**31 - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


def check_unicode(value: str) -> str:
    """``value`` unchanged if it is valid Unicode text (encodable as UTF-8).

    JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which Python decodes into a
    string that no UTF-8 encoder accepts: it could cross no process boundary and appear in
    no response.

    Raises:
        ValueError: the string holds a lone surrogate (the message says where).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text holds a lone surrogate (U+{ord(value[exc.start]):04X} at character "
            f"{exc.start}), which is not valid Unicode"
        ) from None
    return value


#: A JSON string that is valid Unicode (every text field of a request).
Text = Annotated[StrictStr, AfterValidator(check_unicode)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")

#: Most samples per prompt (``n``); more is refused with a 400.
MAX_N = 128

#: Most ``tools`` in one request (OpenAI's limit); each one's schema is checked.
MAX_TOOLS = 128

#: Largest ``repetition_penalty`` (vLLM's bound).
MAX_REPETITION_PENALTY = 2.0

#: ``logit_bias`` values are clamped to this magnitude, as OpenAI documents.
MAX_LOGIT_BIAS = 100.0

#: OpenAI / vLLM fields this server does not implement; accepted only at these neutral
#: values (a 400 otherwise), so a client never silently gets something it did not ask for.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    # vLLM's extensions
    "prompt_logprobs": (None,),  # served on /v1/completions (a field there)
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
}


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` values, of the same JSON type too
    (``true`` is not ``1``, ``0`` is not ``false``)."""
    return any(value == n and type(value) is type(n) for n in neutral)


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a final chunk carries the token counts."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


Penalty = Annotated[FiniteFloat, Field(ge=-2, le=2)]


class RequestBody(BaseModel):
    """A request body: unknown fields allowed (and ignored unless a subclass checks
    them), and an explicit ``null`` for a field with a default means that default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit ``null`` for a field with a default means that default (OpenAI
        marks these fields nullable; clients send unset fields as null)."""
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if value is not None or key not in cls.model_fields
            }
        return data


class ChatTranslated(RequestBody):
    """A request of another API that is served as a chat completion (`to_chat`): the
    Responses API, Anthropic Messages. Errors found on the chat path are reported in the
    request's own field names (`api_names`)."""

    #: ``(pattern, replacement)`` pairs (regular expressions) from chat field names, as
    #: errors write them, to this API's.
    CHAT_NAMES: ClassVar[tuple[tuple[str, str], ...]] = ()

    def to_chat(self) -> ChatCompletionRequest:
        """The chat-completion request this request asks for.

        Raises:
            APIError: a 400 naming the field at fault.
        """
        raise NotImplementedError

    def api_names(self, param: str | None, message: str) -> tuple[str | None, str]:
        """An error's ``param`` and message with chat field names put in this API's."""
        for pattern, replacement in self.CHAT_NAMES:
            message = re.sub(pattern, replacement, message)
            if param is not None:
                param = re.sub(rf"^{pattern}$", replacement, param)
        return param, message

    def validated_chat(self, body: dict[str, Any], param: str) -> ChatCompletionRequest:
        """``body`` validated as a `ChatCompletionRequest`; a validation error is a 400
        naming the field (in this API's names; ``param`` when none is named)."""
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            message, named = validation_message(RequestValidationError(exc.errors()))
            named, message = self.api_names(named or param, message)
            raise bad_request(message, named) from exc


def check_json_text(value: Any, name: str) -> None:
    """Refuse a JSON value (object, list, string) holding a lone surrogate anywhere, in a
    key or a string, that a response would echo.

    Raises:
        APIError: 400 naming ``name``.
    """
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"{name} holds a lone surrogate (such as \\ud800), which is not valid Unicode", name
        ) from None


class GenerationRequest(RequestBody):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: Text | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: FiniteFloat | None = Field(default=None, ge=0, le=1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: FiniteFloat | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    logit_bias: dict[str, FiniteFloat] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0, le=INT32_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Structured output (OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields); at most one of them, see `structured_output`.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    _structured_output: StructuredOutput | None = PrivateAttr(default=None)
    _structured_checked: bool = PrivateAttr(default=False)
    _structured_limits_checked: bool = PrivateAttr(default=False)
    #: Grammars still to build for `structured_output`: (spec, message prefix, param).
    _grammar_checks: list[tuple[StructuredOutput, str, str]] = PrivateAttr(default_factory=list)
    _structured_param: str | None = PrivateAttr(default=None)
    #: Close every object schema (`close_object_schemas`); False: only ``strict`` ones.
    _close_schemas: bool = PrivateAttr(default=True)
    #: The server's ``--tool-call-parser`` serving ``tool_choice: "auto"`` (None: none).
    _tool_call_parser: str | None = PrivateAttr(default=None)

    def set_server_options(
        self, *, tool_call_parser: str | None = None, disable_additional_properties: bool = True
    ) -> None:
        """How this server reads the request's output constraints; call it before
        `structured_output_chars` (the defaults otherwise).

        Args:
            tool_call_parser: the format ``tool_choice: "auto"`` calls are written in
                (``--tool-call-parser``), or None when the server serves no "auto".
            disable_additional_properties: vLLM's name (``--structured-outputs-config``):
                an object schema generates only the properties it lists, unless it says
                otherwise (`close_object_schemas`; xgrammar's reading, vLLM's default).
                False reads schemas as JSON Schema does (unlisted properties allowed),
                except ``strict`` ones (a ``strict: true`` format or function).
        """
        self._tool_call_parser = tool_call_parser
        self._close_schemas = disable_additional_properties

    def check_supported(self) -> None:
        """Raise a 400 for a field this server does not implement (given a non-neutral value).

        Raises:
            APIError: naming the field.
        """
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        extra = self.model_extra or {}
        for name, value in extra.items():
            neutral = _NEUTRAL_VALUES.get(name)
            if neutral is not None and not is_neutral(value, neutral):
                raise bad_request(f"`{name}` is not supported by this server", name)

    def parsed_logit_bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token_id, bias)`` pairs, biases clamped to ±100.

        Raises:
            APIError: a key is not a token id of this vocabulary (400, param logit_bias).
        """
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            token = int(key) if _TOKEN_ID_KEY.fullmatch(key) else -1
            if not 0 <= token < vocab_size:
                raise bad_request(
                    f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                    "logit_bias",
                )
            pairs.append((token, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, value))))
        return tuple(pairs)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    def sampling_params(
        self,
        max_tokens: int,
        vocab_size: int,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        """The engine's `SamplingParams` for this request with ``max_tokens`` resolved.

        Args:
            defaults: the server's defaults (``--generation-config``) of ``temperature``,
                ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``, each used
                only when the request leaves that field unset.

        Raises:
            APIError: a bad ``logit_bias`` key.
        """
        server = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
        server["repetition_penalty"] = 1.0
        server.update(defaults or {})

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return server[name] if value is None else value

        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=int(pick("top_k")),
            min_p=pick("min_p"),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            logit_bias=self.parsed_logit_bias(vocab_size),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=self.stop_strings,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.structured_output(),
        )

    @property
    def asks_for_structured_output(self) -> bool:
        """Whether any structured-output field is given (its check grows with the spec:
        the server runs `structured_output` in a worker thread first)."""
        fields = (self.response_format, self.structured_outputs, self.guided_json)
        others = (self.guided_regex, self.guided_choice, self.guided_grammar)
        return any(value is not None for value in (*fields, *others))

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint this request asks for, checked (no tokenizer needed);
        computed once, later calls return the same result.

        Raises:
            APIError: a 400 naming the field: more than one constraint, a malformed one,
                or one the grammar library cannot enforce (an unimplemented JSON Schema
                keyword, for example).
        """
        if not self._structured_checked:
            self.structured_output_chars()
            for spec, name, param in self._grammar_checks:
                try:
                    check_structured_output(spec)
                except StructuredOutputError as exc:
                    raise bad_request(f"{name}: {exc}", param) from exc
            self._grammar_checks = []
            self._structured_checked = True
        return self._structured_output

    def structured_output_chars(self) -> int:
        """The cheap half of `structured_output`: find the output constraint and check
        it against this server's size limits (time linear in its text); the characters
        of spec whose grammars are still to be built. Computed once.

        Raises:
            APIError: as `structured_output`, but never after building a grammar.
        """
        if not self._structured_limits_checked:
            self._structured_output = self._check_structured_output()
            self._structured_limits_checked = True
        return sum(len(spec.spec) for spec, _, _ in self._grammar_checks)

    def _check_spec(self, spec: StructuredOutput, name: str, param: str | None = None) -> None:
        """Check ``spec`` against this server's size limits now, and queue its grammar's
        check for `structured_output`.

        Raises:
            APIError: a 400 whose message starts with ``name`` and names ``param``
                (``name`` when None).
        """
        try:
            check_spec_limits(spec)
        except StructuredOutputError as exc:
            raise bad_request(f"{name}: {exc}", param or name) from exc
        self._grammar_checks.append((spec, name, param or name))

    def _check_structured_output(self) -> StructuredOutput | None:
        close = self._close_schemas
        found = [
            (name, spec)
            for name, spec in (
                ("response_format", _from_response_format(self.response_format, close)),
                ("structured_outputs", _from_structured_outputs(self.structured_outputs, close)),
                ("guided_json", _json_spec(self.guided_json, "guided_json", close)),
                ("guided_regex", _plain("regex", self.guided_regex)),
                ("guided_choice", _choice_spec(self.guided_choice, "guided_choice")),
                ("guided_grammar", _plain("grammar", self.guided_grammar)),
            )
            if spec is not None
        ]
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise bad_request(f"give one output constraint, not several ({names})", found[1][0])
        name, spec = found[0]
        self._structured_param = name
        self._check_spec(spec, name)
        return spec

    @property
    def structured_param(self) -> str | None:
        """The field that gave the output constraint (``tools`` for a forced tool call),
        once `structured_output` ran; None without a constraint."""
        return self._structured_param if self._structured_output is not None else None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings (a batch), a list of token ids, or a list of
    lists of token ids (a batch). ``max_tokens`` defaults to 16 (OpenAI's and vLLM's
    default) and may be 0 only with ``echo``. ``prompt_logprobs`` (vLLM's) reports each
    prompt token's logprob and that many alternatives in the non-streamed response.
    """

    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=INT32_MAX)
    suffix: Text | None = None

    def check_supported(self) -> None:
        """As `GenerationRequest.check_supported`; tools are a chat feature (a 400 here).

        Raises:
            APIError: naming the field.
        """
        super().check_supported()
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice"):
            if extra.get(name) not in (None, [], "none"):
                raise bad_request(f"`{name}` is only supported on /v1/chat/completions", name)


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a chat message."""

    type: Literal["text"]
    text: Text


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Refuse content parts other than text (images, audio, files) by name: the
        models served take text only."""
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: the model "
                        "served here takes text only (send text parts or a string)"
                    )
        return data

    def text(self) -> str:
        """The content as one string."""
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)


class PromptMessage(_Message):
    """A system, developer or user message: ``content`` (a string or text parts)."""

    role: Literal["system", "developer", "user"]
    content: Text | list[TextContentPart]

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        return {"role": self.role, "content": self.text()}


class ToolMessage(_Message):
    """A tool's result (``role: "tool"``), answering the call ``tool_call_id``."""

    role: Literal["tool"]
    content: Text | list[TextContentPart]
    tool_call_id: Text

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        return {"role": "tool", "content": self.text(), "tool_call_id": self.tool_call_id}


class FunctionCall(BaseModel):
    """The function of an assistant's tool call; ``arguments`` is JSON text (nested at
    most `trio_llm.api.parsing.MAX_JSON_DEPTH` levels: the chat template walks it)."""

    name: Text
    arguments: Annotated[Text, AfterValidator(check_json_text_depth)]


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the response carried it."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Message):
    """An assistant message; ``content`` may be left out (OpenAI allows it here only),
    as it is when the turn made ``tool_calls``."""

    role: Literal["assistant"]
    content: Text | list[TextContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it: tool calls with their arguments
        decoded, as Hugging Face templates expect (left as text if not JSON)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _decoded(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # too deep: `FunctionCall` refuses it first
        return arguments


#: One chat message, told apart by ``role``.
ChatMessage = Annotated[PromptMessage | ToolMessage | AssistantMessage, Field(discriminator="role")]


#: A function name as OpenAI allows it.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(BaseModel):
    """A tool's function: ``name``, ``description``, ``parameters`` (a JSON Schema of
    the arguments object) and ``strict`` (calls are always held to the schema here)."""

    model_config = ConfigDict(extra="allow")

    name: Text
    description: Text | None = None
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


def _json_spec(value: Any, name: str, close: bool = False) -> StructuredOutput | None:
    """A JSON Schema given as an object or as JSON text; with ``close``, its object
    schemas closed (`close_object_schemas`)."""
    if value is None:
        return None
    if isinstance(value, str):
        if json_text_too_deep(value):
            raise nested_too_deep(name)
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{name}: the schema is not valid JSON ({exc})", name) from exc
    if not isinstance(value, dict | bool):
        raise bad_request(f"{name}: a JSON Schema must be an object", name)
    if close:
        value = close_object_schemas(value)
    return StructuredOutput("json", json.dumps(value))


def _plain(kind: str, value: str | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput(kind, value)


def _choice_spec(value: list[str] | None, name: str) -> StructuredOutput | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{name} must list at least one choice", name)
    return StructuredOutput("choice", json.dumps(value))


def _from_response_format(value: dict[str, Any] | None, close: bool) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (its
    object schemas closed with ``close`` or ``strict: true``)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return StructuredOutput("json_object")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise bad_request(
                "response_format.json_schema must be an object with a name and a schema",
                "response_format",
            )
        close = close or schema.get("strict") is True
        return _json_spec(schema.get("schema", {}), "response_format", close)
    raise bad_request(
        "response_format must be {type: text}, {type: json_object} or {type: json_schema, "
        "json_schema: {name, schema, strict}}",
        "response_format",
    )


#: vLLM's ``structured_outputs`` keys and the `StructuredOutput` kind of each.
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_structured_outputs(value: dict[str, Any] | None, close: bool) -> StructuredOutput | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object (other keys: a 400); a JSON Schema's objects closed with ``close``."""
    if value is None:
        return None
    name = "structured_outputs"
    given = {key: v for key, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(f"{name}: {unknown} are not supported by this server", name)
    if len(given) != 1:
        raise bad_request(f"{name} must give one of {list(_STRUCTURED_OUTPUTS_KEYS)}", name)
    ((key, spec),) = given.items()
    if key == "json":
        return _json_spec(spec, name, close)
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise bad_request(f"{name}.choice must be a list of strings", name)
        return _choice_spec(spec, name)
    if not isinstance(spec, str):
        raise bad_request(f"{name}.{key} must be a string", name)
    return StructuredOutput(key, spec)
