"""LoRA adapters made by peft (the reference implementation) for the tests of issue 45."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

#: Every projection an adapter may target.
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapter(
    base: torch.nn.Module | Path,
    path: Path,
    *,
    seed: int,
    targets: tuple[str, ...] = ALL_MODULES,
    rank: int = 8,
    alpha: float = 16,
    **lora: object,
) -> Path:
    """Write a random (not zero: ``init_lora_weights=False``) PEFT LoRA adapter of
    ``base`` (a model, or its folder) to ``path``; ``lora``: more `LoraConfig` fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(base, Path):
        base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        **lora,  # type: ignore[arg-type]
    )
    with warnings.catch_warnings():  # peft reads a transformers property deprecated in v5
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, config)
    model.save_pretrained(path)
    # get_peft_model wraps base's modules in place: unwrap them for the next adapter.
    model.unload()
    return path


def merged_model(base_dir: Path, adapter: Path | None) -> torch.nn.Module:
    """The float32 model of ``base_dir`` with ``adapter`` merged into its weights by peft
    (``merge_and_unload``), or the base model alone (``adapter`` None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    return model


def greedy_reference(
    model: torch.nn.Module, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens after ``prompt`` (at most ``max_tokens``, up to
    EOS) and each one's logprob."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(score[0].float(), -1)[token].item()
        for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs
