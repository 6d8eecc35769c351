"""The catalog of models one server serves: --model flags with their aliases and the
files and folders of --models-dir, found again on a rescan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trio_llm.server.model_catalog import Catalog, flagged_entries, scan_models_dir


def _hf(folder: Path, *, sentence_transformers: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if sentence_transformers:
        (folder / "modules.json").write_text("[]")
    return folder


def test_a_models_dir_holds_gguf_files_and_both_kinds_of_folder(tmp_path: Path) -> None:
    (tmp_path / "tiny.Q4_1.gguf").write_bytes(b"GGUF")
    _hf(tmp_path / "chat-model")
    _hf(tmp_path / "minilm", sentence_transformers=True)
    reranker = _hf(tmp_path / "reranker", sentence_transformers=True)  # as CrossEncoder saves
    config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"]}
    (reranker / "config.json").write_text(json.dumps(config))
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty-folder").mkdir()
    _hf(tmp_path / ".hidden")
    found = {entry.name: entry for entry in scan_models_dir(tmp_path)}
    assert sorted(found) == ["chat-model", "minilm", "reranker", "tiny.Q4_1"]
    assert found["reranker"].kind == "cross-encoder"
    assert found["tiny.Q4_1"].kind == "gguf"
    assert found["chat-model"].kind == "hf"
    assert found["minilm"].kind == "sentence-transformers"
    assert found["minilm"].model == str((tmp_path / "minilm").resolve())
    with pytest.raises(NotADirectoryError, match="--models-dir"):
        scan_models_dir(tmp_path / "notes.txt")


def test_served_model_name_groups_follow_the_model_flags_in_order(tmp_path: Path) -> None:
    chat = _hf(tmp_path / "chat")
    entries = flagged_entries([str(chat), "smollm2"], [["chat", "gpt-4o"]])
    assert [e.names for e in entries] == [("chat", "gpt-4o"), ("smollm2",)]
    assert entries[0].kind == "hf" and entries[1].kind == "named"
    with pytest.raises(ValueError, match="2 --served-model-name groups for 1 --model"):
        flagged_entries(["a"], [["x"], ["y"]])
    with pytest.raises(ValueError, match="given to both"):
        Catalog(flagged_entries(["a", "b"], [["same"], ["same"]]))


def test_flags_win_name_clashes_and_a_rescan_follows_the_folder(tmp_path: Path) -> None:
    models = tmp_path / "models"
    _hf(models / "one")
    _hf(models / "taken")
    catalog = Catalog(flagged_entries(["/somewhere/else"], [["taken"]]), models)
    assert catalog.names() == ["taken", "one"]
    assert catalog.default.model == "/somewhere/else"
    assert catalog.get("taken").source == "flag"
    _hf(models / "two")
    (models / "one" / "config.json").unlink()
    added, removed = catalog.rescan()
    assert [e.name for e in added] == ["two"] and [e.name for e in removed] == ["one"]
    assert catalog.get("one") is None and catalog.get("two").source == "dir"


def test_no_model_at_all_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model to serve"):
        Catalog([], tmp_path)


def _config(*argv: str):
    from trio_llm.cli.main import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_the_flags_of_several_models_make_the_servers_catalog(tmp_path: Path) -> None:
    from trio_llm.server.model_catalog import catalog_of

    one = _config("--model", "m.gguf", "--served-model-name", "a", "b")
    assert not one.models.several and one.served_model_names == ("a", "b")
    assert catalog_of(one).names() == ["a", "b"]
    models = tmp_path / "models"
    _hf(models / "extra")
    several = _config(
        "--model", "m1", "--served-model-name", "chat",
        "--model", "m2",
        "--models-dir", str(models),
        "--max-loaded-models", "2",
        "--keep-alive", "5m",
    )  # fmt: skip
    assert several.models.several and several.engine.model.model == "m1"
    assert several.models.max_loaded_models == 2 and several.models.keep_alive == 300.0
    catalog = catalog_of(several)
    assert catalog.names() == ["chat", "m2", "extra"] and catalog.default.model == "m1"
    # A models folder alone: its first model is the default.
    folder_only = _config("--models-dir", str(models))
    assert folder_only.engine.model.model == str((models / "extra").resolve())
    assert _config("--keep-alive", "-1").models.keep_alive is None
    assert _config("--keep-alive", "0").models.keep_alive == 0.0
    assert _config("--max-loaded-models", "0").models.max_loaded_models is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--served-model-name", "a", "--served-model-name", "b"], "2 --served-model-name"),
        (["--model", "x", "--model", "y", "--served-model-name", "s", "--served-model-name", "s"],
         "given to both"),
    ],
)  # fmt: skip
def test_served_name_groups_that_do_not_fit_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*argv)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("300", 300.0), ("-1", None),
     ("forever", None), ("0", 0.0), (12, 12.0), (-5, None)],
)  # fmt: skip
def test_keep_alive_durations(text: object, seconds: float | None) -> None:
    from trio_llm.server_config import keep_alive_seconds

    assert keep_alive_seconds(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "5x", True, [1], "nan"])
def test_keep_alive_refuses_what_is_not_a_duration(text: object) -> None:
    from trio_llm.server_config import keep_alive_seconds

    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(text)


def test_a_second_model_without_a_name_is_served_under_its_file_or_folder_name(
    tmp_path: Path,
) -> None:
    """Issue 41, item 12: a second --model without --served-model-name was served (and
    had to be requested) under its host path. The first keeps vLLM's rule: the string as
    given."""
    chat = _hf(tmp_path / "chat")
    minilm = _hf(tmp_path / "minilm", sentence_transformers=True)
    (tmp_path / "tiny.Q4_1.gguf").write_bytes(b"GGUF")
    models = [str(chat), str(minilm) + "/", str(tmp_path / "tiny.Q4_1.gguf"), "smollm2"]
    entries = flagged_entries(models)
    assert [e.names for e in entries] == [(str(chat),), ("minilm",), ("tiny.Q4_1",), ("smollm2",)]
    assert [e.model for e in entries] == models  # what the engines load is unchanged
    catalog = Catalog(flagged_entries(["smollm2", str(tmp_path / "tiny.Q4_1.gguf")]))
    assert catalog.names() == ["smollm2", "tiny.Q4_1"]
    # A model card's root: a named model's string as given (vLLM's), a local one's name.
    _hf(tmp_path / "dir" / "found")
    catalog = Catalog(flagged_entries(["smollm2", str(chat)], [["s"], ["c"]]), tmp_path / "dir")
    assert [e.root for e in catalog.entries] == ["smollm2", "c", "found"]
