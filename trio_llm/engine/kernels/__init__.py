"""The engine's native CPU kernels: a torch C++ extension, built once per machine.

The sources are ``csrc/*.cpp`` in this package. Each file registers its operators in the
``trio_llm`` namespace (``TORCH_LIBRARY_FRAGMENT``), so they are called as
``torch.ops.trio_llm.<name>``. They are compiled into one shared library with the
system's C++ compiler (``$CXX``, else ``c++``), ``-O3 -march=native``: the compiler
vectorises for the CPU it runs on (AVX-512 where the CPU has it, else AVX2), and the
library is cached under ``<cache dir>/kernels/<key>/``, where the key covers the
sources, the torch version, the compiler and the CPU's instruction-set flags. A session
on another CPU model builds its own.

`make install` builds it (``python -m trio_llm.engine.kernels``); the engine loads it at
start-up (`load`) and builds it then if it is missing. Where there is no compiler, or
the build fails, or ``--attention-backend TORCH_SDPA`` is given, the engine runs the
pure-torch reference path (`trio_llm.engine.attention`), which also serves as the
reference the kernels are tested against. One log line says which path runs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trio_llm.config import default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
LIBRARY_NAME = "trio_llm_kernels.so"

#: CPU flags (``/proc/cpuinfo``) that change what ``-march=native`` emits, as far as
#: these kernels are concerned.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the native kernels are loaded, and why not.

    Attributes:
        loaded: ``torch.ops.trio_llm`` holds the kernels.
        detail: the library path and ISA when loaded; else why the reference path runs.
    """

    loaded: bool
    detail: str

    def describe(self) -> str:
        """One log line: which attention path runs."""
        if self.loaded:
            return f"attention: native CPU kernels ({self.detail})"
        return f"attention: pure-torch reference path ({self.detail})"


def cpu_isa() -> tuple[str, ...]:
    """The `ISA_FLAGS` this CPU reports (empty where ``/proc/cpuinfo`` is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return tuple(flag for flag in ISA_FLAGS if flag in flags)
    return ()


def compiler() -> str | None:
    """The C++ compiler's path (``$CXX``, else ``c++``), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _compiler_version(cxx: str) -> str:
    result = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else cxx


def _key(cxx: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.suffix in {".cpp", ".h"}:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(_compiler_version(cxx).encode())
    digest.update(",".join(cpu_isa()).encode())
    digest.update(platform.machine().encode())
    return digest.hexdigest()[:16]


def library_path(cache_dir: Path | None = None) -> Path | None:
    """Where this machine's library is (or would be) cached; None without a compiler."""
    cxx = compiler()
    if cxx is None:
        return None
    return (cache_dir or default_cache_dir()) / "kernels" / _key(cxx) / LIBRARY_NAME


def _command(cxx: str, output: Path) -> list[str]:
    # torch's own include and library folders (what torch.utils.cpp_extension uses,
    # without importing it: it needs setuptools, a build-time package).
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    command += ["-Wall", "-Wno-unused-function", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    command += [
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    command += [f"-I{SOURCES}"]
    command += [str(path) for path in sorted(SOURCES.glob("*.cpp"))]
    command += [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]
    command += ["-lc10", "-ltorch_cpu", "-o", str(output)]
    return command


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernels for this machine unless its library is cached.

    Returns:
        The library's path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output attached).
    """
    cxx = compiler()
    target = library_path(cache_dir)
    if cxx is None or target is None:
        raise RuntimeError("no C++ compiler found ($CXX or c++)")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent build or a crash never leaves a
    # half-written library under the final name.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / LIBRARY_NAME
        result = subprocess.run(_command(cxx, output), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"building the native kernels failed:\n{result.stderr[-4000:]}")
        os.replace(output, target)
    return target


@functools.cache
def load(cache_dir: Path | None = None, build_if_missing: bool = True) -> KernelStatus:
    """Load this machine's kernels into ``torch.ops.trio_llm`` (building them first when
    ``build_if_missing``); never raises: a failure is the returned status.

    Only CPU kernels exist: on a machine with a GPU the caller does not use them.
    """
    if os.environ.get("TRIO_LLM_NATIVE_KERNELS", "1") == "0":
        return KernelStatus(False, "TRIO_LLM_NATIVE_KERNELS=0")
    try:
        path = library_path(cache_dir)
        if path is None:
            return KernelStatus(False, "no C++ compiler found ($CXX or c++)")
        if not path.exists():
            if not build_if_missing:
                return KernelStatus(False, f"not built ({path})")
            path = build(cache_dir)
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as error:
        logger.debug("native kernels unavailable", exc_info=True)
        return KernelStatus(False, str(error).splitlines()[0])
    isa = torch.ops.trio_llm.isa()
    return KernelStatus(True, f"{isa}, {path}")


def main() -> int:
    """``python -m trio_llm.engine.kernels``: build (or find) this machine's library."""
    cxx = compiler()
    if cxx is None:
        print("no C++ compiler found: the engine will run its pure-torch reference path")
        return 0
    try:
        build()
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    status = load()
    print(status.describe())
    return 0 if status.loaded else 1
