"""Give a model folder that holds only a config and a tokenizer random weights.

    python bench/random_weights.py MODEL_DIR [--dtype bfloat16] [--set num_hidden_layers=2 ...]

For benchmark machines the real weights cannot reach (the device machine takes at most
64 MiB of files; SmolLM2-135M's weights are 270 MB in bf16): a model of the same shape
costs exactly the same arithmetic per token, so throughput figures carry over. Its text
is gibberish, so only fixed-length (``ignore_eos``) workloads make sense with it. Writes
``model.safetensors`` with transformers' own initialisation (normal, std
``initializer_range``); does nothing when the folder already has weights.

``--set FIELD=VALUE`` changes the configuration first (saved with the weights): a model
of a few tiny layers over the same vocabulary makes engine steps so cheap that the API
server's own per-token work is what a benchmark measures (docs/benchmarks.md, "The API
server's work per token").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="an integer field"
    )
    args = parser.parse_args()
    if (args.model_dir / "model.safetensors").exists():
        print(f"{args.model_dir} already has weights")
        return
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_dir)
    for item in args.set:
        field, value = item.split("=", 1)
        setattr(config, field, int(value))
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote random {args.dtype} weights ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
