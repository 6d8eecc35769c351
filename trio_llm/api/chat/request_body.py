"""What every request body of the API shares: its text and number types, and its base model.

Every text field is `Text` (valid Unicode, so it can cross a process boundary and appear in
a response), every float `FiniteFloat`, every token id `TokenId`. `RequestBody` ignores
unknown fields (as OpenAI does) and reads an explicit ``null`` as the field's default;
`refuse_unimplemented` refuses a field this server does not implement unless it is given
only at its neutral value (`is_neutral`). A body also knows its lane
(`trio_llm.api.http.lanes`, bound from the ASGI scope) and makes the engine requests'
`Scheduling` from it and the ``priority`` field of the APIs that have one
(`RequestBody.scheduling`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    StrictStr,
    model_validator,
)

from trio_llm.api.http.errors import bad_request
from trio_llm.api.http.lanes import BATCH_LANE, INTERACTIVE_LANE, Lane
from trio_llm.messages import Scheduling

#: Largest integer accepted where the engine takes a 64-bit or 32-bit value.
INT32_MAX = 2**31 - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]

#: vLLM's ``priority`` field: any 64-bit integer, lower is handled earlier (0 unless the
#: server runs ``--scheduling-policy priority``).
Priority = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]


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


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` values, of the same JSON type too
    (``true`` is not ``1``, ``0`` is not ``false``)."""
    return any(value == n and type(value) is type(n) for n in neutral)


def refuse_unimplemented(
    extra: Mapping[str, Any] | None, neutral_values: Mapping[str, tuple[Any, ...]], yet: str = ""
) -> None:
    """Refuse the first of the fields ``extra`` (a body's unknown fields) that
    ``neutral_values`` lists with a value that is not one of its neutral ones.

    Args:
        yet: appended to the message ("`name` is not supported by this server").

    Raises:
        APIError: 400 naming the field.
    """
    for name, value in (extra or {}).items():
        neutral = neutral_values.get(name)
        if neutral is not None and not is_neutral(value, neutral):
            raise bad_request(f"`{name}` is not supported by this server{yet}", name)


class RequestBody(BaseModel):
    """A request body: unknown fields allowed (and ignored unless a subclass checks
    them), and an explicit ``null`` for a field with a default means that default."""

    model_config = ConfigDict(extra="allow")

    _lane: Lane = PrivateAttr(default=INTERACTIVE_LANE)
    _data_parallel_rank: int | None = PrivateAttr(default=None)

    def bind_lane(self, lane: Lane) -> None:
        """Put the request in ``lane`` (`trio_llm.api.http.lanes.lane_of` its ASGI scope)."""
        self._lane = lane

    def bind_data_parallel_rank(self, rank: int | None) -> None:
        """Send the request to the engine of this rank (vLLM's ``X-data-parallel-rank``
        header, checked by `trio_llm.api.http.lanes.data_parallel_rank_of`), or None:
        the router chooses."""
        self._data_parallel_rank = rank

    def bind_like(self, other: RequestBody) -> None:
        """Give this request (a translation of ``other``) ``other``'s lane and rank."""
        self._lane = other._lane
        self._data_parallel_rank = other._data_parallel_rank

    @property
    def lane(self) -> Lane:
        """The request's lane: ``"interactive"`` unless `bind_lane` said otherwise."""
        return self._lane

    def scheduling(self, priority: int, policy: str) -> Scheduling:
        """The `Scheduling` of the request's engine requests: ``priority`` (its field),
        its lane and its data-parallel rank.

        Args:
            policy: the engine's scheduling policy (`EngineReady.scheduling_policy`).

        Raises:
            APIError: 400 naming ``priority``: a nonzero one under ``fcfs``.
        """
        scheduling = Scheduling(
            priority, batch=self._lane == BATCH_LANE, data_parallel_rank=self._data_parallel_rank
        )
        try:
            scheduling.validate(policy)
        except ValueError as exc:
            raise bad_request(
                f"{exc} (the server runs with --scheduling-policy {policy})", "priority"
            ) from None
        return scheduling

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


def known_fields(body: BaseModel) -> dict[str, Any]:
    """The fields of ``body`` that its model (and each nested model) knows and the client
    set, as JSON: the request as a store keeps it. Unknown fields, which a body accepts
    and ignores (`RequestBody`), are left out at every level, so a client cannot make
    the store keep what no response needs."""
    return body.model_dump(mode="json", exclude_unset=True, exclude=_unknown(body))


def _unknown(body: BaseModel) -> dict[str, Any]:
    """pydantic's ``exclude`` of ``body``'s unknown fields, nested models' too."""
    exclude: dict[str, Any] = dict.fromkeys(body.model_extra or {}, True)
    for name in body.model_fields_set & set(type(body).model_fields):
        value = getattr(body, name)
        if isinstance(value, BaseModel) and (inner := _unknown(value)):
            exclude[name] = inner
    return exclude


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


class DescribedTool(BaseModel):
    """A tool offered to the model, in any API: its ``name`` and ``description`` (unknown
    fields allowed); each API's tool model adds its schema fields."""

    model_config = ConfigDict(extra="allow")

    name: Text
    description: Text | None = None
