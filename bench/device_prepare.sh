#!/usr/bin/env bash
# Prepares what bench/device_run.sh needs on a lent GPU machine (docs/benchmarks.md, "On a
# GPU"), both ignored by git and passed to the device tool's carry:
#   .whl/      wheels for Python 3.12 (x86_64) of trio_llm's runtime dependencies that
#              the GPU image lacks, at the versions of this .venv, plus pytest, pytest-trio
#              and py-spy (torch, transformers, tokenizers, safetensors, numpy: the image's);
#   .devmodel/ SmolLM2-135M-Instruct's config and tokenizer, no weights
#              (bench/random_weights.py makes random ones there).
#   bash bench/device_prepare.sh
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
rm -rf .whl .devmodel
mkdir -p .whl .devmodel
# Runtime dependencies (transitively) at this venv's versions, minus the GPU image's own.
mapfile -t wanted < <("$py" - <<'EOF'
import importlib.metadata as md
import re

IMAGE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub",
         "hf-xet", "filelock", "fsspec", "pyyaml", "requests", "urllib3", "certifi",
         "charset-normalizer", "tqdm", "packaging", "regex", "jinja2", "markupsafe",
         "typing-extensions", "sympy", "mpmath", "networkx", "setuptools", "triton",
         }
EXTRA = ["pytest", "pluggy", "iniconfig", "pytest-trio", "py-spy"]

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

from packaging.requirements import Requirement

TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "extra": "",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
seen, todo = set(), ["trio_llm", *EXTRA]
while todo:
    name = norm(todo.pop())
    if name in seen or name in IMAGE or name.startswith("nvidia-"):
        continue
    seen.add(name)
    for text in md.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET):
            todo.append(req.name)
for name in sorted(seen - {"trio-llm"}):
    print(f"{name}=={md.version(name)}")
EOF
)
"$py" -m pip download -q --no-deps --only-binary=:all: --dest .whl \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "${wanted[@]}"
model=$("$py" -c 'from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir
print(resolve_model_dir(DEFAULT_MODEL, default_cache_dir()))')
for file in config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -e "$model/$file" ]; then cp "$model/$file" .devmodel/; fi
done
du -sh .whl .devmodel
echo "carry: [\".whl\", \".devmodel\"]; run: bash bench/device_run.sh 256 200"
