"""`hybridrl export`: a Hugging Face model directory from a run's checkpoint (checkpoint.py's layout).
DeepSpeed's zero_to_fp32 consolidates the ZeRO-2/3 shards; a LoRA run's checkpoint becomes an adapter
in PEFT's format (and, asked for, the base model with it merged in).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import yaml

from hybridrl.core import models
from hybridrl.core.config import Config, UserError, torch_dtype
from hybridrl.run.checkpoint import DS_TAG, ckpt_root, complete_checkpoints, is_complete


def checkpoint_of(src: str | Path) -> Path:
    """Checkpoint `src` itself, or the newest complete checkpoint of run directory `src`."""
    src = Path(src)
    if is_complete(src):
        return src
    from hybridrl.core.config import load

    cfg = load(src / "config.yaml") if (src / "config.yaml").exists() else Config()
    found = complete_checkpoints(ckpt_root(cfg, src))
    if not found:
        raise UserError(f"{src}: no complete checkpoint under {ckpt_root(cfg, src)}")
    return found[0]


def export(src: str | Path, out: str | Path, merged: bool = False, trust_remote_code: bool = False) -> Path:
    """A Hugging Face model directory from the newest complete checkpoint of run `src` (or from
    checkpoint `src` itself). DeepSpeed's zero_to_fp32 consolidates ZeRO-2 and ZeRO-3 shards.
    A LoRA run's checkpoint holds the adapter only: `out` gets it in PEFT's format (and, with
    `merged`, `out/merged` the base model with the adapter merged in); see export_adapter.
    `trust_remote_code` comes from today's command line, never from the checkpoint's config: a
    run directory can be anyone's (checkpoint.from_run_dir)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hybridrl.engines import deepspeed_compat

    ck, out = checkpoint_of(src), Path(out)
    cfg = yaml.safe_load((ck / "config.yaml").read_text())
    dtype = torch_dtype(cfg["model"]["dtype"])
    state = deepspeed_compat.fp32_state_dict(str(ck), DS_TAG)
    state = {k.removeprefix("hf."): v for k, v in state.items()}  # the trainer wraps the HF model as .hf
    if cfg["model"].get("lora_rank"):
        export_adapter(ck, cfg, state, Path(out), merged, dtype, trust_remote_code)
        return ck
    if merged:
        raise UserError(
            f"{ck}: --merged is for LoRA runs (model.lora_rank > 0); this run trained every weight, "
            "so the export is already the whole model: drop --merged"
        )
    hf_cfg = AutoConfig.from_pretrained(ck / "hf", trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, trust_remote_code=trust_remote_code)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(hf_cfg, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"{ck}: checkpoint does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ck / "hf").save_pretrained(out)
    if (ck / "hf" / "generation_config.json").exists():
        shutil.copy(ck / "hf" / "generation_config.json", out / "generation_config.json")
    return ck


def export_adapter(
    ck: Path, cfg: dict, state: dict, out: Path, merged: bool, dtype: torch.dtype, trust_remote_code: bool = False
) -> None:
    """The adapter of a LoRA run in PEFT's format (adapter_config.json, adapter_model.safetensors:
    `PeftModel.from_pretrained(base, out)` and vLLM's `LoRARequest(..., out)` load it) plus the
    tokenizer; with `merged`, `out/merged` holds base + adapter merged, a plain model directory.
    The base model is model.path, which the run read its frozen weights from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.core.config import ModelConfig
    from hybridrl.engines import lora

    m = ModelConfig(**{**cfg["model"], "trust_remote_code": trust_remote_code})
    base = str(models.DEMO) if m.path == "demo" else m.path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=m.trust_remote_code)
    peft_model = lora.attach(model, m)
    adapter = {n for n, _ in model.named_parameters() if lora.is_adapter(n)}
    if set(state) != adapter:
        raise RuntimeError(
            f"{ck}: the checkpoint's adapter does not match model.lora_* of its config: missing "
            f"{sorted(adapter - set(state))[:5]}, unexpected {sorted(set(state) - adapter)[:5]}"
        )
    model.load_state_dict(state, strict=False)
    peft_model.to(dtype).save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(ck / "hf")
    tokenizer.save_pretrained(out)
    if merged:
        full = peft_model.merge_and_unload()
        full.save_pretrained(out / "merged", safe_serialization=True)
        tokenizer.save_pretrained(out / "merged")
        if (ck / "hf" / "generation_config.json").exists():
            shutil.copy(ck / "hf" / "generation_config.json", out / "merged" / "generation_config.json")


def export_critic(src: str | Path, out: str | Path, trust_remote_code: bool = False) -> Path:
    """The critic of a PPO run (algo.advantage=gae) from its newest complete checkpoint (or
    checkpoint `src`): a token-classification model with one label (`AutoModelForTokenClassification`,
    as verl saves its critic), whose logit at each position is the critic's value of the state there;
    `--algo.critic_path OUT` starts a later run's critic from it, value head included. Its base model
    is the one the run's critic started from (algo.critic_path, else the policy's)."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from hybridrl.engines import deepspeed_compat
    from hybridrl.engines.critic import TAG

    ck, out = checkpoint_of(src), Path(out)
    if not (ck / TAG).is_dir():
        raise UserError(
            f"{ck}: no critic in this checkpoint (the run did not use algo.advantage=gae); export the "
            "policy without --critic"
        )
    cfg = yaml.safe_load((ck / "config.yaml").read_text())
    remote = trust_remote_code  # today's flag, not the checkpoint's (see export)
    base = cfg["algo"].get("critic_path") or ck / "hf"
    try:
        hf_cfg = AutoConfig.from_pretrained(base, num_labels=1, trust_remote_code=remote)
        model = AutoModelForTokenClassification.from_config(hf_cfg, dtype=torch.float32, trust_remote_code=remote)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{ck}: cannot build a token-classification model of the critic's base {base} "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    head = next(n for n, m in model.named_children() if isinstance(m, nn.Linear) and m.out_features == 1)
    state = deepspeed_compat.fp32_state_dict(str(ck), TAG)
    mapped = {
        f"{model.base_model_prefix}.{k.removeprefix('base.')}"
        if k.startswith("base.")
        else f"{head}.{k.removeprefix('head.')}": v
        for k, v in state.items()
    }
    if getattr(model, head).bias is None:  # a head without a bias: only a zero one can be dropped
        if mapped.pop(f"{head}.bias").abs().max() > 0:
            raise UserError(f"{ck}: the critic's value head has a bias, {type(model).__name__}.{head} has none")
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"{ck}: the critic does not match {type(model).__name__}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.to(torch_dtype(cfg["model"]["dtype"])).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ck / "hf").save_pretrained(out)
    return ck
