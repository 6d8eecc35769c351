"""Give a model folder that holds only a config and a tokenizer random weights.

    python bench/random_weights.py MODEL_DIR [--dtype bfloat16]

For benchmark machines the real weights cannot reach (the device machine takes at most
64 MiB of files; SmolLM2-135M's weights are 270 MB in bf16): a model of the same shape
costs exactly the same arithmetic per token, so throughput figures carry over. Its text
is gibberish, so only fixed-length (``ignore_eos``) workloads make sense with it. Writes
``model.safetensors`` with transformers' own initialisation (normal, std
``initializer_range``); does nothing when the folder already has weights.
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
    args = parser.parse_args()
    if (args.model_dir / "model.safetensors").exists():
        print(f"{args.model_dir} already has weights")
        return
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote random {args.dtype} weights ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
