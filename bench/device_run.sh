#!/usr/bin/env bash
# The prepared GPU run (docs/benchmarks.md, "On a GPU"): everything in one call of the
# device tool. Run `bash bench/device_prepare.sh` here first and carry .whl and .devmodel;
# results go to $OUT.
#   bash bench/device_run.sh [NUM_PROMPTS] [OUTPUT_LEN]
# An estimate of 6 minutes on the H200 (never timed there): give the call timeout_s=540.
# DEVICE=cpu runs the same steps on the CPU (float32, smaller cache): how the script is
# tried without a GPU, e.g. `DEVICE=cpu PYTHON=.venv/bin/python bash bench/device_run.sh 4 8`.
set -uo pipefail
prompts=${1:-256}
output_len=${2:-200}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "$device" = cuda ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    dtype=bfloat16 kv=16GiB
else
    dtype=float32 kv=1GiB
fi
"$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

# 1. Correctness on the device: captured decode graphs give the eager engine's tokens.
"$python" -m pytest -q -p no:cacheprovider tests/unit/engine/test_cuda_graphs.py 2>&1 |
    tail -n 5 | tee "$out/pytest.txt"

# 2. The seed workload (random weights of SmolLM2-135M's shapes: the carry limit).
model=/tmp/trio-llm-devmodel  # a copy: .devmodel keeps no weights (the carry limit)
rm -rf "$model" && cp -r .devmodel "$model"
"$python" bench/random_weights.py "$model" || exit 1
common=(--model "$model" --device "$device" --dtype "$dtype" --input-len 250
    --output-len "$output_len" --max-num-seqs 256 --max-num-batched-tokens 8192
    --kv-cache-memory "$kv")
"$python" bench/throughput.py "${common[@]}" --num-prompts "$prompts" \
    --json "$out/offline.json" 2>&1 | grep -v Warning
"$python" bench/throughput.py "${common[@]}" --num-prompts "$prompts" --enforce-eager \
    --json "$out/offline_eager.json" 2>&1 | grep -v Warning
# The servers against the offline engine, then a pass with py-spy on every process.
"$python" bench/serve_vs_offline.py "${common[@]}" --num-prompts "$prompts" \
    --profile "$out/profiles" --json "$out/serve_vs_offline.json" 2>&1 |
    tee "$out/serve_vs_offline.txt"
# vLLM's --stream-interval: fewer, bigger SSE events (the API server's work per token).
"$python" bench/serve_vs_offline.py "${common[@]}" --num-prompts "$prompts" --modes inline \
    --stream-interval 8 --json "$out/serve_vs_offline_si8.json" 2>&1 |
    tee "$out/serve_vs_offline_si8.txt"
for n in 1 16 64; do
    "$python" bench/throughput.py "${common[@]}" --num-prompts "$n" \
        --json "$out/offline_$n.json" 2>&1 | grep -v Warning
done
"$python" bench/gpu_targets.py "$out" | tee "$out/targets.txt"
