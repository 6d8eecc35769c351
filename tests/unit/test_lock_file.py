"""requirements.lock, the exact versions `make install` installs (docs/development.md).

Always: every dependency pyproject.toml names (the runtime ones and the `dev` extra's) is
pinned in the lock at a version its specifier allows, every pin carries its sha256 hashes,
and torch and the model packages are pinned as the Makefile says. Inside the virtual
environment `make install` made (the Makefile's stamp, ``.installed``, in ``sys.prefix``):
every locked distribution is installed at exactly its locked version. Elsewhere (the
container image, `make test-newest`'s .venv-newest) that comparison skips and says why.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
MAKEFILE = ROOT / "Makefile"
#: Touched by the Makefile's $(STAMP) rule once the venv holds the lock and the project.
STAMP = Path(sys.prefix) / ".installed"
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Pin:
    version: Version
    hashes: tuple[str, ...]


def parse_lock(text: str) -> dict[str, Pin]:
    """The pins of a hashed requirements file as uv writes it, by canonical name:
    ``name==version \\`` and one ``--hash=sha256:...`` per continuation line; comment and
    blank lines aside. Anything else (a range, an option line, a name twice) is an error."""
    pins: dict[str, Pin] = {}
    for line in text.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        first, *rest = line.split()
        requirement = Requirement(first)
        specifiers = list(requirement.specifier)
        if len(specifiers) != 1 or specifiers[0].operator != "==" or requirement.extras:
            raise ValueError(f"not an exact pin: {line.strip()!r}")
        if any(not HASH.fullmatch(word) for word in rest):
            raise ValueError(f"not a sha256 hash option in {line.strip()!r}")
        name = canonicalize_name(requirement.name)
        if name in pins:
            raise ValueError(f"{name} pinned twice")
        pins[name] = Pin(Version(specifiers[0].version), tuple(rest))
    return pins


@cache
def locked() -> dict[str, Pin]:
    return parse_lock(LOCK.read_text())


def version_mismatches(
    pins: dict[str, Pin], installed: Callable[[str], str] = version
) -> list[str]:
    """One line per pin that ``installed`` (a distribution name -> its version, raising
    PackageNotFoundError when there is none) does not have at exactly the locked version."""
    found = []
    for name, pin in sorted(pins.items()):
        try:
            have = Version(installed(name))
        except PackageNotFoundError:
            found.append(f"{name}: locked {pin.version}, not installed")
            continue
        if have != pin.version:
            found.append(f"{name}: locked {pin.version}, installed {have}")
    return found


def makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} := (.+)$", MAKEFILE.read_text(), re.MULTILINE)
    assert match, f"no {name} in the Makefile"
    return match.group(1).strip()


def test_the_parser_reads_uv_pins_and_refuses_anything_else() -> None:
    sha = "0123456789abcdef" * 4
    text = (
        "# header\n"
        f"Typing_Extensions==4.15.0 \\\n    --hash=sha256:{sha} \\\n    --hash=sha256:{sha}\n"
        "    # via torch\n\n"
        f"torch==2.13.0+cpu \\\n    --hash=sha256:{sha}\n"
    )
    assert parse_lock(text) == {
        "typing-extensions": Pin(Version("4.15.0"), (f"--hash=sha256:{sha}",) * 2),
        "torch": Pin(Version("2.13.0+cpu"), (f"--hash=sha256:{sha}",)),
    }
    for bad in (
        "torch>=2.6\n",
        "--find-links /opt/wheels\n",
        "torch==2.13.0 --hash=md5:00\n",
        "torch==2.13.0\ntorch==2.14.1\n",
    ):
        with pytest.raises(ValueError):
            parse_lock(bad)


def test_the_lock_pins_every_dependency_pyproject_names_at_an_allowed_version() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    pins = locked()
    wrong = []
    for line in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": "dev"}):
            continue
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            wrong.append(f"{requirement.name}: not in the lock")
        elif not requirement.specifier.contains(pin.version, prereleases=True):
            wrong.append(f"{requirement.name}: locked {pin.version}, pyproject says {line!r}")
    assert not wrong, "run `make lock` (see docs/development.md):\n" + "\n".join(wrong)


def test_every_pin_carries_its_hashes() -> None:
    unhashed = [name for name, pin in locked().items() if not pin.hashes]
    assert len(locked()) > 100
    assert not unhashed


def test_torch_and_the_model_packages_are_pinned_as_the_makefile_says() -> None:
    pins = locked()
    # The CPU build: PyPI's plain 2.13.0 is the CUDA one.
    assert pins["torch"].version == Version(makefile_variable("TORCH") + "+cpu")
    for package in makefile_variable("MODEL_PACKAGES").split():
        requirement = Requirement(package)
        pin = pins[canonicalize_name(requirement.name)]
        assert str(requirement.specifier) == f"=={pin.version}"


def test_a_version_other_than_the_locked_one_is_reported() -> None:
    pins = {
        "torch": Pin(Version("2.13.0+cpu"), ()),
        "transformers": Pin(Version("5.25.0"), ()),
        "trio": Pin(Version("0.35.0"), ()),
        "numpy": Pin(Version("2.4.6"), ()),
    }
    installed = {"torch": "2.13.0", "transformers": "5.26.0", "trio": "0.35"}

    def lookup(name: str) -> str:
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    assert version_mismatches(pins, lookup) == [
        "numpy: locked 2.4.6, not installed",
        "torch: locked 2.13.0+cpu, installed 2.13.0",
        "transformers: locked 5.25.0, installed 5.26.0",
    ]


def test_the_environment_make_install_made_holds_exactly_the_lock() -> None:
    if not STAMP.exists():
        pytest.skip(
            f"{sys.prefix} is not a virtual environment `make install` made (no "
            f"{STAMP.name} in it): there the installed versions are not the lock's"
        )
    mismatches = version_mismatches(locked())
    assert not mismatches, (
        f"{sys.prefix} does not hold {LOCK.name}: run `make install`\n" + "\n".join(mismatches)
    )
