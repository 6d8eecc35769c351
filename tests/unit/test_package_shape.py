"""The package's shape holds what docs/design.md says: who may import whom, no cycles, sizes.

An `ast` scan of every module under ``trio_llm/`` (no import runs): each ``import`` and
``from ... import`` anywhere in a module (at the top, in a function, under
``if TYPE_CHECKING:``) is an arrow from that module to the `trio_llm` module it names.
design.md's table ("Processes and packages") is the reference: its first column names the
modules or packages of a row, its last the rows they may import (before "—") and those
they never may (after it). "everything" allows any row; "nothing" none.

The sizes are the issue-33 limits: no file above 450 lines, no function above 60 (the
declarative tables design.md names under "Long by design" aside).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trio_llm"
DESIGN = ROOT / "docs" / "design.md"

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    """``trio_llm/api/app.py`` -> ``trio_llm.api.app``; an ``__init__.py`` -> its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The `trio_llm` modules that module ``name`` (file ``path``) imports, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            # ``from trio_llm import ipc`` imports the submodule; ``from x import name``, x.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (the import cycles), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _names(cell: str) -> list[str]:
    """The backticked names of a table cell, as row keys: ``config.py`` -> ``config``."""
    return [name.removesuffix(".py").rstrip("/") for name in re.findall(r"`([^`]+)`", cell)]


def design_rules() -> dict[str, tuple[set[str] | None, set[str]]]:
    """design.md's table: row key -> (rows it may import, or None for any; rows it never may)."""
    text = DESIGN.read_text()
    section = text.split("## Processes and packages", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, tuple[set[str] | None, set[str]]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may, _, never = cells[2].partition("—")
        allowed: set[str] | None = set(_names(may))
        if may.strip().startswith("everything"):
            allowed = None
        rule = (allowed, set(_names(never)))  # one object per row: its modules share it
        for key in _names(cells[0]):
            rules[key] = rule
    return rules


def row_of(module: str, rules: dict[str, tuple[set[str] | None, set[str]]]) -> str | None:
    """The table row a module belongs to: its own file's row, else its package's."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    for depth in range(len(parts), 0, -1):
        key = "/".join(parts[:depth])
        if key in rules:
            return key
    return None


def test_the_design_table_is_read() -> None:
    rules = design_rules()
    # Hand-picked rows and rules of design.md: the parse found the table, not nothing.
    assert {"errors", "messages", "engine", "api", "frontend", "text"} <= set(rules)
    assert "api" in rules["engine"][1]
    assert "engine" in rules["api"][1]


def test_every_module_has_a_row_in_the_design_table() -> None:
    rules = design_rules()
    missing = [name for name in modules() if row_of(name, rules) is None]
    assert missing == [], f"modules design.md's table does not place: {missing}"


def test_no_import_cycles() -> None:
    assert strongly_connected(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check above can fail: a hand-made graph with one two-module cycle and a tail.
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b"]]


def test_no_forbidden_import_arrows() -> None:
    rules = design_rules()
    bad = []
    for source, targets in sorted(import_graph().items()):
        source_row = row_of(source, rules)
        if source_row is None:
            continue
        allowed, never = rules[source_row]
        for target in sorted(targets):
            target_row = row_of(target, rules)
            if target_row is None or rules[target_row] is rules[source_row]:
                continue  # the same row (one row may name several modules)
            top = target_row.split("/")[0]
            if (
                top in never
                or target_row in never
                or (allowed is not None and target_row not in allowed and top not in allowed)
            ):
                bad.append(f"{source} -> {target} ({source_row} may not import {target_row})")
    assert bad == []


def long_by_design() -> set[str]:
    """The ``path:function`` names design.md lists as declarative tables, allowed to be long."""
    section = DESIGN.read_text().split("### Long by design", 1)
    if len(section) == 1:
        return set()
    return set(re.findall(r"`([\w/]+\.py(?::\w+)?)`", section[1].split("\n#", 1)[0]))


def test_no_file_above_the_line_limit() -> None:
    allowed = long_by_design()
    long_files = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
        and str(path.relative_to(PACKAGE)) not in allowed
    }
    assert long_files == {}


def test_no_function_above_the_line_limit() -> None:
    allowed = long_by_design()
    long_functions = {}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in allowed:
                    long_functions[f"{rel}:{node.name}"] = n
    assert long_functions == {}


def test_no_assert_statement_guards_anything() -> None:
    """``python -O`` drops every ``assert`` (vLLM's CVE-2026-41523 vanished so): the
    package checks with ``if ...: raise`` instead (ruff's S101 on ``trio_llm/`` too)."""
    asserts = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert asserts == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from trio_llm import ipc\n", {"trio_llm.ipc"}),
        ("from trio_llm.api.http.errors import APIError\n", {"trio_llm.api.http.errors"}),
        ("from . import errors\n", {"trio_llm.api.http.errors"}),
        ("from ...text.choice import Choice\n", {"trio_llm.text.choice"}),
        ("def f():\n    import trio_llm.engine.core\n", {"trio_llm.engine.core"}),
        ("import json\nfrom typing import Any\n", set()),
    ],
)
def test_the_scan_reads_each_form_of_import(
    tmp_path: Path, source: str, expected: set[str]
) -> None:
    known = modules()
    path = tmp_path / "scanned.py"
    path.write_text(source)
    assert set(imported("trio_llm.api.http.scanned", path, known)) == expected
