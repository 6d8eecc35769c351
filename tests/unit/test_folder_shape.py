"""The package's folder level holds what docs/design.md says (issue 43): small folders, one
package per API with the same roles, a chat core that names no other API, and imports
between the API packages that are acyclic and shallow.

Like `tests.unit.test_package_shape` (whose import scan this reuses), nothing is imported:
the files are read.
"""

from __future__ import annotations

import functools
import re

from tests.unit.test_package_shape import PACKAGE, import_graph, strongly_connected

#: The most modules (``.py`` files, ``__init__.py`` included) a folder may hold; the engine
#: is the one folder allowed more (its kernels and model families are one concern each).
MAX_FOLDER_MODULES = 16
#: The most modules `trio_llm/api/` keeps of its own beside its sub-packages.
MAX_API_OWN_MODULES = 8
#: The longest chain of imports between API nodes (each sub-package one node).
MAX_API_DEPTH = 5

#: The APIs translated into a chat completion: each has the same roles.
TRANSLATED_APIS = ("anthropic", "responses")
ROLES = ("request.py", "format.py", "handlers.py")


def folder_sizes() -> dict[str, int]:
    return {
        str(folder.relative_to(PACKAGE.parent)): len(list(folder.glob("*.py")))
        for folder in [PACKAGE, *PACKAGE.rglob("*")]
        if folder.is_dir() and (folder / "__init__.py").exists()
    }


def test_no_folder_but_the_engine_holds_more_than_16_modules() -> None:
    sizes = folder_sizes()
    assert "trio_llm/api/chat" in sizes and sizes["trio_llm"] > 1  # the scan saw the tree
    too_big = {
        folder: n
        for folder, n in sizes.items()
        if n > MAX_FOLDER_MODULES and folder != "trio_llm/engine"
    }
    assert too_big == {}


def test_api_keeps_few_modules_of_its_own() -> None:
    own = [p.name for p in (PACKAGE / "api").glob("*.py") if p.name != "__init__.py"]
    assert 0 < len(own) <= MAX_API_OWN_MODULES, own


def test_every_translated_api_has_the_same_roles() -> None:
    missing = [
        f"api/{api}/{role}"
        for api in TRANSLATED_APIS
        for role in ROLES
        if not (PACKAGE / "api" / api / role).exists()
    ]
    assert missing == []


def test_the_chat_core_and_http_name_no_other_api() -> None:
    """The grep of issue 43's target 3, over the files' text (comments and docstrings too)."""
    pattern = re.compile(r"MessagesRequest|ResponsesRequest")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for folder in ("chat", "http")
        for path in sorted((PACKAGE / "api" / folder).glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def api_node(module: str) -> str | None:
    """The node of an `trio_llm.api` module: its sub-package, or itself for the api
    folder's own modules; None outside `trio_llm.api`."""
    parts = module.split(".")
    if parts[:2] != ["trio_llm", "api"] or len(parts) < 3:
        return None
    return ".".join(parts[:3])


def api_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source, targets in import_graph().items():
        node = api_node(source)
        if node is None:
            continue
        graph.setdefault(node, set())
        for target in targets:
            other = api_node(target)
            if other is not None and other != node:
                graph[node].add(other)
    return graph


def longest_chain(graph: dict[str, set[str]]) -> int:
    """The most nodes on one import path of an acyclic ``graph``."""

    @functools.cache
    def depth(node: str) -> int:
        return 1 + max((depth(child) for child in graph.get(node, ())), default=0)

    return max(depth(node) for node in graph)


def test_the_api_packages_import_each_other_acyclically_and_shallowly() -> None:
    graph = api_graph()
    assert {"trio_llm.api.chat", "trio_llm.api.http", "trio_llm.api.app"} <= set(graph)
    assert strongly_connected(graph) == []
    assert longest_chain(graph) <= MAX_API_DEPTH


def test_the_chain_measure_counts_nodes() -> None:
    # The measure above can fail: a hand-made chain of three nodes and a branch.
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == 3
