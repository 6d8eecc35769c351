"""Every module of the installed package imports with its runtime dependencies alone.

The dev extra (httpx, pytest, hypothesis, openai, playwright, ...) is absent on a plain
``pip install trio_llm``; test support that needs it lives in ``tests/support``, not in the
package. A fresh interpreter (so nothing is imported already) whose import system cannot
see those names imports every ``trio_llm`` module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import trio_llm

#: Starts a fresh interpreter (a subprocess): the slow tier.
pytestmark = pytest.mark.slow


def _distribution(requirement: str) -> str:
    """A requirement's distribution name, normalized: ``"pytest-trio>=0.8"`` -> ``pytest-trio``."""
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group()).lower()


def dev_only_names() -> list[str]:
    """The top-level import names of pyproject's optional dependencies (the dev and bench
    extras), as installed here, less those that a runtime dependency needs too (directly or
    through its own requirements): what a plain ``pip install trio_llm`` lacks. And ``tests``."""
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]
    extras = {
        _distribution(r) for group in project["optional-dependencies"].values() for r in group
    }
    runtime: set[str] = set()
    todo = [_distribution(r) for r in project["dependencies"]]
    while todo:
        name = todo.pop()
        if name in runtime:
            continue
        runtime.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(_distribution(r) for r in requires if "extra ==" not in r)
    hidden = {
        top
        for top, dists in metadata.packages_distributions().items()
        if {_distribution(d) for d in dists} & extras
        and not {_distribution(d) for d in dists} & runtime
    }
    return sorted(hidden | {"tests"})


SCRIPT = """
import importlib
import importlib.abc
import pkgutil
import sys

BLOCKED = set(sys.argv[1:])


class HideDevOnly(importlib.abc.MetaPathFinder):
    # The usual finders, blind to the dev-only names: as on a plain install, importing
    # one raises ModuleNotFoundError and importlib.util.find_spec returns None (which
    # torch and transformers use to probe for optional packages).

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args, **kwargs):
        for finder in self.finders:
            if hasattr(finder, "find_distributions"):
                yield from finder.find_distributions(*args, **kwargs)

    def invalidate_caches(self):
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


sys.meta_path[:] = [HideDevOnly(list(sys.meta_path))]
for loaded in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
    del sys.modules[loaded]

import trio_llm


def fail(package):
    raise


names = [
    info.name
    for info in pkgutil.walk_packages(trio_llm.__path__, "trio_llm.", onerror=fail)
    if info.name.rsplit(".", 1)[-1] != "__main__"
]
for name in names:
    importlib.import_module(name)
print("\\n".join(names))
"""


def test_every_module_imports_without_dev_dependencies(tmp_path: Path) -> None:
    root = str(Path(trio_llm.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *dev_only_names()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = done.stdout.split()
    assert "trio_llm.cli.main" in imported, imported
    assert len(imported) > 10, imported


def test_the_dev_only_list_comes_from_pyproject() -> None:
    names = dev_only_names()
    # Test clients pyproject's dev extra lists, by their import names; none of the runtime's.
    assert {"pytest", "httpx", "openai", "hypothesis", "tests"} <= set(names)
    assert not {"trio", "torch", "transformers", "fastapi", "pydantic", "msgspec"} & set(names)
