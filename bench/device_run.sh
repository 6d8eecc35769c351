#!/usr/bin/env bash
# The prepared GPU run (docs/benchmarks.md, "On a GPU"): one call of the device tool.
# Carry .whl (trio_llm's pure-Python dependencies the GPU image lacks, for Python 3.12)
# and .devmodel (SmolLM2-135M's config and tokenizer, no weights); results go to $OUT.
#   bash bench/device_run.sh [NUM_PROMPTS] [OUTPUT_LEN]
set -uo pipefail
prompts=${1:-256}
output_len=${2:-200}
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 bench/random_weights.py .devmodel || exit 1
common=(--model .devmodel --device cuda --dtype bfloat16 --input-len 250
    --output-len "$output_len" --max-num-seqs 256 --max-num-batched-tokens 8192
    --kv-cache-memory 16GiB)
python3 bench/serve_vs_offline.py "${common[@]}" --num-prompts "$prompts" \
    --json "$out/serve_vs_offline.json" 2>&1 | tee "$out/serve_vs_offline.txt"
for n in 1 16 64; do
    python3 bench/throughput.py "${common[@]}" --num-prompts "$n" \
        --json "$out/offline_$n.json" 2>&1 | grep -v Warning
done
