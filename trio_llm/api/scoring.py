"""Score and rerank: vLLM's ``POST /score`` and ``/v1/score``, and its ``/rerank``,
``/v1/rerank`` and ``/v2/rerank`` (the bodies Jina's and Cohere's rerank clients send).

Served by a cross-encoder (an engine of task ``score``: a sequence-classification model):
each (query, document) pair is tokenized as the model's tokenizer encodes a pair (its
special tokens, the second text's segment id 1 passed as `SamplingParams.second_text_start`)
and its score is the model's activated logit, as sentence-transformers'
``CrossEncoder.predict`` gives it. Or by an embedding model: each text is embedded once,
and a pair's score is the cosine of its two vectors, as sentence-transformers'
``util.cos_sim`` gives it. Both run the plan, admission, engine batching and disconnect
handling of ``/v1/embeddings`` (`trio_llm.api.embeddings.pooling_plan`,
`collect_embeddings`).

- ``/score``: ``text_1`` and ``text_2``, each a string or a list of strings: one against
  one, one against many, or many against as many (pairs in order); ``data[i].score``.
- ``/rerank``: ``query`` and ``documents`` (strings, or objects with a ``text``), with
  ``top_n`` (0 or absent: all) and ``return_documents`` (default true, as vLLM and Jina
  answer); ``results`` best first, each with the document's ``index`` and its
  ``relevance_score``.

Fields that would change the result and are not served (``truncate_prompt_tokens``,
Cohere's ``max_tokens_per_doc`` and ``rank_fields``) are a 400 naming them.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from typing import Any

import msgspec
import trio
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.types import Receive

from trio_llm.api.chat.plan import Plan
from trio_llm.api.chat.request_body import Priority, RequestBody, Text
from trio_llm.api.chat.run_choices import run_connected
from trio_llm.api.chat.serving import ModelServing
from trio_llm.api.embeddings import (
    collect_embeddings,
    embedding_prompts,
    pooling_plan,
)
from trio_llm.api.http.body_reading import CLIENT_CLOSED_REQUEST
from trio_llm.api.http.errors import bad_request, invalid_request
from trio_llm.errors import ContextLengthError, InvalidRequest
from trio_llm.frontend.preprocess import InputPreprocessor
from trio_llm.messages import SamplingParams, Scheduling

#: Fields of vLLM's and Cohere's bodies that would change the scores and are not served.
UNSERVED_FIELDS = ("truncate_prompt_tokens", "max_tokens_per_doc", "rank_fields")


def _texts(value: str | list[str], param: str, limit: int) -> list[str]:
    """One side of the pairs as a list, checked: not empty, no empty text, at most
    ``limit`` (``--max-score-texts``).

    Raises:
        APIError: 400 naming ``param``.
    """
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    if len(items) > limit:
        raise bad_request(
            f"{len(items)} texts is more than the limit of {limit} per request (--max-score-texts)",
            param,
        )
    if any(not item for item in items):
        raise bad_request(f"{param} must not contain an empty string", param)
    return items


class _ScoringBody(RequestBody):
    """What score and rerank requests share."""

    model: Text | None = None
    priority: Priority = 0

    def check_served(self) -> None:
        """Refuse a field that would change the scores (`UNSERVED_FIELDS`).

        Raises:
            APIError: 400 naming it.
        """
        extra = self.model_extra or {}
        for name in UNSERVED_FIELDS:
            if extra.get(name) is not None:
                raise bad_request(f"`{name}` is not supported by this server", name)


class ScoreRequest(_ScoringBody):
    """``POST /score`` (vLLM's fields)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]

    def pairs(self, limit: int) -> tuple[list[str], list[str], list[tuple[int, int]]]:
        """The two sides and the pairs to score, as indices into them, in order (at most
        ``limit`` texts a side).

        Raises:
            APIError: 400: an empty side or text, too many, or lists of two lengths
                (other than one against many).
        """
        first = _texts(self.text_1, "text_1", limit)
        second = _texts(self.text_2, "text_2", limit)
        if len(first) == 1:
            return first, second, [(0, j) for j in range(len(second))]
        if len(first) != len(second):
            raise bad_request(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                "or as many as text_2",
                "text_2",
            )
        return first, second, [(i, i) for i in range(len(first))]


class RerankDocument(BaseModel):
    """A document given as an object (Cohere's and Jina's ``{"text": ...}``)."""

    model_config = ConfigDict(extra="allow")

    text: Text


class RerankRequest(_ScoringBody):
    """``POST /rerank`` (vLLM's, Jina's and Cohere's fields)."""

    query: Text
    documents: list[Text | RerankDocument]
    top_n: StrictInt = Field(default=0, ge=0)
    return_documents: StrictBool = True

    def document_texts(self, limit: int) -> list[str]:
        """Each document's text, in order (at most ``limit``).

        Raises:
            APIError: 400 naming ``documents``: none, an empty one, or too many.
        """
        texts = [d if isinstance(d, str) else d.text for d in self.documents]
        return _texts(texts, "documents", limit)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine of two vectors (0.0 when either is all zeros)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


#: Pairs tokenized on the event loop; more go to a worker thread.
INLINE_PAIRS = 8

#: The pooling tasks (`EngineReady.task`) these routes serve.
SCORING_TASKS = ("score", "embed")


async def _run(serving: ModelServing, plan: Plan, receive: Receive) -> list[list[float]] | None:
    """Admit ``plan`` and collect each request's vector (in order); None when the client
    left."""
    admission = serving.admit(plan)
    vectors: list[list[float]] = [[] for _ in plan.requests]
    collect = functools.partial(collect_embeddings, serving.engine, plan, admission, vectors)
    if not await run_connected(serving.engine, receive, admission, collect):
        return None
    return vectors


async def pair_prompts(
    inputs: InputPreprocessor, pairs: list[tuple[str, str]], params: tuple[str, str]
) -> tuple[list[list[int]], list[int | None]]:
    """Each (first, second) text pair's token ids as the tokenizer encodes a pair (with its
    special tokens), and where its second text's segment starts (None: the tokenizer
    gives every token segment 0, as RoBERTa's does).

    Raises:
        APIError: 400 for a pair longer than the context (never cut), naming the field
            (of ``params``, the two sides') of its longer text.
    """
    backend, max_model_len = inputs.tokenizer.backend, inputs.max_model_len

    def tokenize() -> tuple[list[list[int]], list[int | None]]:
        prompts, starts = [], []
        for first, second in pairs:
            encoding = backend.encode(first, second, add_special_tokens=True)
            ids, types = encoding.ids, encoding.type_ids
            param = params[0] if len(first) > len(second) else params[1]
            if len(ids) > max_model_len:
                raise ContextLengthError(max_model_len, len(ids), param, prompt_name=param)
            start = types.index(1) if 1 in types else None
            if start is not None and any(t != 1 for t in types[start:]):
                raise bad_request("this model's tokenizer gives segment ids out of order", param)
            prompts.append(ids)
            starts.append(start)
        return prompts, starts

    try:
        if len(pairs) <= INLINE_PAIRS:
            return tokenize()
        return await trio.to_thread.run_sync(tokenize)
    except InvalidRequest as exc:
        raise invalid_request(exc) from exc


async def _pair_scores(
    serving: ModelServing,
    model: str,
    sides: tuple[tuple[list[str], str], tuple[list[str], str]],
    pairs: list[tuple[int, int]],
    scheduling: Scheduling,
    receive: Receive,
) -> tuple[list[float], int] | None:
    """Score ``pairs`` (indices into the sides) with a cross-encoder, one engine request a
    pair (batched with other clients'); with the prompt tokens scored. None when the
    client left.

    Raises:
        APIError: 400 for a pair longer than the context (naming the field of its longer
            text); 503 when the waiting line is full.
    """
    (texts_1, param_1), (texts_2, param_2) = sides
    texts = [(texts_1[i], texts_2[j]) for i, j in pairs]
    prompts, starts = await pair_prompts(serving.inputs, texts, (param_1, param_2))
    params = [SamplingParams(max_tokens=0, second_text_start=start) for start in starts]
    plan = pooling_plan(prompts, scheduling, model, serving.inputs, params)
    vectors = await _run(serving, plan, receive)
    if vectors is None:
        return None
    return [vector[0] for vector in vectors], sum(plan.prompt_lengths)


async def _scores(
    serving: ModelServing,
    model: str,
    sides: tuple[tuple[list[str], str], tuple[list[str], str]],
    pairs: list[tuple[int, int]],
    scheduling: Scheduling,
    receive: Receive,
) -> tuple[list[float], int] | None:
    """``pairs`` scored by the served model: a cross-encoder's scores, or an embedding
    model's cosines."""
    score = _pair_scores if serving.engine.info.task == "score" else _cosine_scores
    return await score(serving, model, sides, pairs, scheduling, receive)


def _check_scoring_model(serving: ModelServing, endpoint: str, model: str) -> None:
    """Refuse a model that generates text (a 400 naming ``model``)."""
    if serving.engine.info.task not in SCORING_TASKS:
        serving.check_task("embed", endpoint, model)


async def _cosine_scores(
    serving: ModelServing,
    model: str,
    sides: tuple[tuple[list[str], str], tuple[list[str], str]],
    pairs: list[tuple[int, int]],
    scheduling: Scheduling,
    receive: Receive,
) -> tuple[list[float], int] | None:
    """Embed both sides' texts (each distinct text once, batched with other clients') and
    score ``pairs`` (indices into the sides) by cosine; with the prompt tokens embedded.
    None when the client left.

    Raises:
        APIError: 400 for a text the model cannot take (named by its side's field); 503
            when the waiting line is full.
    """
    distinct: list[list[str]] = []
    prompts: list[list[int]] = []
    for texts, param in sides:
        unique = list(dict.fromkeys(texts))
        distinct.append(unique)
        prompts += await embedding_prompts(serving.inputs, unique, param)
    plan = pooling_plan(prompts, scheduling, model, serving.inputs)
    vectors = await _run(serving, plan, receive)
    if vectors is None:
        return None
    first = {text: vectors[i] for i, text in enumerate(distinct[0])}
    offset = len(distinct[0])
    second = {text: vectors[offset + i] for i, text in enumerate(distinct[1])}
    (texts_1, _), (texts_2, _) = sides
    scores = [cosine(first[texts_1[i]], second[texts_2[j]]) for i, j in pairs]
    return scores, sum(plan.prompt_lengths)


class ScoringAPI:
    """The score and rerank routes (the route table's owner ``scoring``)."""

    async def score(
        self, request: ScoreRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Score each pair of ``text_1`` and ``text_2`` (vLLM's ``ScoreResponse``).

        Raises:
            APIError: 400 for a generating model, empty, too many or too long texts,
                sides of two lengths, or a field not served; 503 when the line is full.
        """
        model = serving.resolve_model(request.model)
        _check_scoring_model(serving, "/score", model)
        request.check_served()
        scheduling = request.scheduling(request.priority, serving.engine.info.scheduling_policy)
        first, second, pairs = request.pairs(serving.limits.max_score_texts)
        sides = ((first, "text_1"), (second, "text_2"))
        scored = await _scores(serving, model, sides, pairs, scheduling, receive)
        if scored is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        scores, tokens = scored
        body: dict[str, Any] = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def rerank(
        self, request: RerankRequest, receive: Receive, serving: ModelServing
    ) -> Response:
        """Order ``documents`` by their score against ``query``, best first (vLLM's
        ``RerankResponse``, which Jina's and Cohere's clients read).

        Raises:
            APIError: as `score`, naming ``query`` or ``documents``.
        """
        model = serving.resolve_model(request.model)
        _check_scoring_model(serving, "/rerank", model)
        request.check_served()
        scheduling = request.scheduling(request.priority, serving.engine.info.scheduling_policy)
        documents = request.document_texts(serving.limits.max_score_texts)
        sides = (([request.query], "query"), (documents, "documents"))
        pairs = [(0, j) for j in range(len(documents))]
        scored = await _scores(serving, model, sides, pairs, scheduling, receive)
        if scored is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        scores, tokens = scored
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
        if request.top_n:
            order = order[: request.top_n]
        results = []
        for j in order:
            result: dict[str, Any] = {"index": j, "relevance_score": scores[j]}
            if request.return_documents:
                result["document"] = {"text": documents[j]}
            results.append(result)
        body = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
        return Response(msgspec.json.encode(body), media_type="application/json")
