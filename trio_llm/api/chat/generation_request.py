"""The fields completions and chat completions share (`GenerationRequest`), and what the
engine is asked from them: `SamplingParams` and the output constraint.

Field names and defaults follow the OpenAI API reference; ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens`` and ``priority`` (the engine
request's place in line, `RequestBody.scheduling`) are vLLM's extensions. Fields that
OpenAI or vLLM define but this server does not implement are accepted only at their
neutral value, so a client never silently gets something other than what it asked for;
unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec
from pydantic import BaseModel, Field, PrivateAttr, StrictBool, StrictInt

from trio_llm.api.chat.request_body import (
    INT32_MAX,
    FiniteFloat,
    Priority,
    RequestBody,
    Text,
    TokenId,
    refuse_unimplemented,
)
from trio_llm.api.chat.sampling_fields import (
    MinP,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
)
from trio_llm.api.chat.structured_spec import CONSTRAINT_FIELDS, given_constraints
from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.parsing import CountedFields
from trio_llm.messages import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput
from trio_llm.structured_output.errors import StructuredOutputError
from trio_llm.structured_output.grammar_check import check_structured_output
from trio_llm.structured_output.spec_limits import check_spec_limits

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")

#: Most samples per prompt (``n``); more is refused with a 400.
MAX_N = 128

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


#: The engine's defaults of the fields a server default (``--generation-config``) or the
#: request may set; `SamplingParams`' own.
_ENGINE_DEFAULTS: dict[str, Any] = {
    field.name: field.default
    for field in msgspec.structs.fields(SamplingParams)
    if field.name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
}


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a final chunk carries the token counts."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class GenerationRequest(RequestBody):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    COUNTED_FIELDS: ClassVar[CountedFields] = CountedFields(
        samples="n", stop="stop", per_token=("logit_bias", "stop_token_ids")
    )

    model: Text | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
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
    priority: Priority = 0
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=1024)
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
        refuse_unimplemented(self.model_extra, _NEUTRAL_VALUES)

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
        server = {**_ENGINE_DEFAULTS, **(defaults or {})}

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
            cache_salt=self.cache_salt,
        )

    @property
    def asks_for_structured_output(self) -> bool:
        """Whether any structured-output field is given (its check grows with the spec:
        the server runs `structured_output` in a worker thread first)."""
        return any(getattr(self, name) is not None for name, _ in CONSTRAINT_FIELDS)

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
        found = given_constraints(self, self._close_schemas)
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
