"""LoRA (model.lora_rank > 0): the adapter the trainer trains and vLLM serves, in one vocabulary.

peft injects the adapter into the trainer's model in place (`attach`): the transformers model the
trainer runs is the same object, its target projections now LoRA layers, the base weights frozen,
so DeepSpeed's optimizer (and its ZeRO partitioning of optimizer states) covers the adapter only.
The hand-off sends the adapter alone, named as a PEFT adapter file names it (`sync_name`), which
is what vLLM's LoRA loader parses; vLLM keeps serving its own copy of the base weights. With the
adapter disabled (`peft.disable_adapter()`) the trainer's model is the base model, which is the
KL reference (reference.py): no second model is loaded.

Departs from verl, the one peer that hands vLLM the adapter alone: verl replaces a method of
vLLM's LoRA manager so that a request can carry tensors; here vllm_compat builds vLLM's own
LoRAModel from the tensors and registers it under a fixed id, so requests name it and vLLM never
looks for a file (see vllm_compat.load_adapter_into_worker). TRL and NeMo-RL merge and push full
weights every step instead.
"""

from __future__ import annotations

import re

from torch import nn

from hybridrl.core import families
from hybridrl.core.config import ModelConfig


def spec(m: ModelConfig) -> dict:
    """The adapter's shape as PEFT's adapter_config.json and vLLM's PEFTHelper read it."""
    return {
        "r": int(m.lora_rank),
        "lora_alpha": float(m.lora_alpha),
        "target_modules": sorted(m.lora_target_modules),
        "bias": "none",
    }


def attach(hf: nn.Module, m: ModelConfig):
    """Inject a fresh adapter into `hf` in place (B = 0: the adapted model equals the base model at
    step 0) and freeze everything else; returns the PeftModel wrapping `hf`."""
    from peft import LoraConfig, get_peft_model

    from hybridrl.core.config import UserError

    # a vision-language model's adapters go on its language model only, as vLLM serves them (its tower
    # LoRA is off by default); Qwen2.5-VL's tower MLP has gate/up/down_proj, which the suffixes would match
    row = families.vision_family(hf.config)
    tower = row.tower if row else None
    present = {
        name.rsplit(".", 1)[-1]
        for name, mod in hf.named_modules()
        if isinstance(mod, nn.Linear) and not (tower and name.startswith(tower))
    }
    missing = sorted(set(m.lora_target_modules) - present)
    if missing:
        raise UserError(
            f"model.lora_target_modules: {missing} name no linear layer of {type(hf).__name__} "
            f"(its linear layers: {sorted(present)}); set --model.lora_target_modules"
        )
    exclude = {"exclude_modules": re.escape(tower) + ".*"} if tower else {}
    peft_model = get_peft_model(hf, LoraConfig(**spec(m), lora_dropout=float(m.lora_dropout), **exclude))
    set_dropout(hf, False)  # peft's new modules start in training mode; hybridrl's model runs in eval mode
    return peft_model


def set_dropout(hf: nn.Module, on: bool) -> None:
    """The adapter's dropout on while training, off for log-probs (the probe, old and reference
    log-probs must be deterministic)."""
    for name, mod in hf.named_modules():
        if name.endswith("lora_dropout"):
            mod.train(on)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def sync_name(name: str) -> str:
    """The trainer's parameter name -> the name in a PEFT adapter file, which vLLM's loader parses:
    model.layers.0.self_attn.q_proj.lora_A.default.weight
    -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    return "base_model.model." + name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
