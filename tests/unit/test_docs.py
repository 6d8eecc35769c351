"""The README and docs/ hold what they promise: every flag documented, links that resolve.

docs/cli.md is the command-line reference: every option string of ``trio-llm serve`` and
``trio-llm run-batch`` (taken from the parser, so a new flag fails here until it is
written down) appears in it. The README stays a five-minute read that names the two
commands, the test one being what CI runs (.ci/run). Every relative link of README.md and
docs/*.md names a file that exists and, into a Markdown file, a heading it has.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trio_llm.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
MARKDOWN = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def subcommand_flags() -> list[tuple[str, str]]:
    """(subcommand, option string) for every option of every subcommand but ``--help``."""
    subparsers = build_parser()._subparsers._group_actions[0].choices
    return [
        (name, option)
        for name, parser in subparsers.items()
        for action in parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]


def mentions(text: str, option: str) -> bool:
    """``--seed`` is in the text as itself, not as a piece of ``--seed-x`` or ``x--seed``."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (code blocks skipped)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_the_flag_parse_finds_the_flags() -> None:
    # Hand-picked flags of both subcommands: the parse found the parser, not nothing.
    flags = subcommand_flags()
    assert ("serve", "--model") in flags
    assert ("serve", "-dp") in flags
    assert ("run-batch", "--input-file") in flags
    assert not mentions("--seed-x --no-seed", "--seed")
    assert mentions("`--seed N`", "--seed")


@pytest.mark.parametrize(("subcommand", "option"), subcommand_flags())
def test_every_flag_is_in_docs_cli(subcommand: str, option: str) -> None:
    assert mentions(CLI_DOC.read_text(), option), f"{subcommand} {option} is not in docs/cli.md"


def test_the_readme_is_short_and_names_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert re.search(r"^make serve\b", text, re.MULTILINE)
    assert re.search(r"^make test\b", text, re.MULTILINE)


def test_ci_runs_the_readme_test_command() -> None:
    ci = ROOT / ".ci" / "run"
    commands = [
        line.strip() for line in ci.read_text().splitlines() if line.strip().startswith("make ")
    ]
    assert commands == ["make test"]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda path: path.name)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (doc.parent / path) if path else doc
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in heading_anchors(destination):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{doc.relative_to(ROOT)}: {broken}"


#: A package path a doc names (``api/chat/planner.py``, ``engine/kernels/csrc/...``):
#: relative to ``trio_llm/``, a folder of it first.
PACKAGE_PATH = re.compile(
    r"(?<![\w/.-])((?:api|frontend|engine|text|server|cli|model_files|store|structured_output"
    r"|detokenizer)(?:/\w+)*/\w+\.(?:py|cpp|h))\b"
)


def named_paths(text: str) -> set[str]:
    return set(PACKAGE_PATH.findall(text))


def test_the_path_scan_finds_paths() -> None:
    text = "see `api/chat/planner.py:Planner` and engine/kernels/csrc/layer_ops.cpp, not x/api/y.py"
    assert named_paths(text) == {"api/chat/planner.py", "engine/kernels/csrc/layer_ops.cpp"}


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda path: path.name)
def test_every_package_path_a_doc_names_exists(doc: Path) -> None:
    missing = sorted(
        path for path in named_paths(doc.read_text()) if not (ROOT / "trio_llm" / path).exists()
    )
    assert missing == []
