"""Does training learn at a real model's shape, and does bfloat16 learn like float32 there?

    python -m bench.learn_scale                          # 134M, bfloat16 then float32, 150 steps each
    python -m bench.learn_scale --dtypes bfloat16 --steps 250

A random-initialised model learns nothing from RL: nothing in it generalises, so a reward has no
structure to amplify. This bench first gives bench/shapes.py's 134M model (SmolLM2-135M's body, its
49,152-token BPE vocabulary trained here) a skill to start from: a supervised warm-up on the demo's
addition task (train split only), in bfloat16 autocast with float32 weights, stopped once greedy
accuracy on 64 held-out prompts reaches --start-acc (330 steps, ~12 minutes on 2 cores). Then one
`hybridrl train` run per dtype on that model (GRPO, the built-in arithmetic reward, 16 prompts x 8
samples of <= 4 tokens, one update per rollout, lr --lr), each evaluating greedy accuracy on the
demo's full 256-prompt held-out split every 25 steps. Prints held-out accuracy, reward and entropy
per window of 25 steps, side by side for the dtypes, and seconds per step by phase, and records
them (bench/results/learn_scale.jsonl). At 134M the bfloat16 run takes ~7 minutes and the float32
one ~10 on 2 cores with AMX.
The warmed model is kept under $HYBRIDRL_CACHE_DIR/shapes/<shape>-arith and reused.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import shapes
from bench.results import record

ROOT = Path(__file__).resolve().parents[1]


def _accuracy(model, tok, rows, encoded) -> float:
    """Greedy exact-match accuracy; the completion decoded without special tokens (as the loop does)."""
    import torch

    from examples.make_demo_model import greedy_decode
    from hybridrl.data.tasks import arithmetic

    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = greedy_decode(model, [p for p, _ in encoded], tok.eos_token_id)
    model.train()
    return sum(
        arithmetic.reward(r["prompt"], tok.decode(c, skip_special_tokens=True), r["answer"]) for r, c in zip(rows, outs)
    ) / len(rows)


def warm_up(shape: str, start_acc: float, seed: int = 0) -> Path:
    """The shape's random model after supervised steps on the addition task's train split, until
    greedy accuracy on 64 held-out prompts reaches start_acc: lr 3e-4 to half of it, then lr 1e-4."""
    out = shapes.cache_root() / f"{shape}-arith"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.make_demo_model import encode_rows, sft_batch
    from hybridrl.data.tasks import arithmetic

    src = shapes.build(shape)
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    train = encode_rows(tok, arithmetic.load("train"))
    held_rows = arithmetic.load("heldout")[:64]
    held = encode_rows(tok, held_rows)
    rng, order, step, t0 = random.Random(seed), [], 0, time.perf_counter()
    for lr, goal in ((3e-4, start_acc / 2), (1e-4, start_acc)):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        acc = 0.0
        while acc < goal:
            step += 1
            if step > 2000:
                raise SystemExit(f"warm-up: held-out accuracy {acc:.1%} after 2000 steps, short of {goal:.0%}")
            if len(order) < 64:
                order += rng.sample(range(len(train)), len(train))
            batch, order = [train[i] for i in order[:64]], order[64:]
            x, y = sft_batch(batch, tok.pad_token_id)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 10 == 0:
                acc = _accuracy(model, tok, held_rows, held)
                print(
                    f"warm-up step {step}: loss {loss.item():.3f}, held-out (64) {acc:.1%}, "
                    f"{time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # whole or absent
    return out


def train(model: Path, dtype: str, args) -> list[dict]:
    run_dir = Path(args.out).resolve() / dtype
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--model",
        str(model),
        "--model.dtype",
        dtype,
        "--data",
        "demo",
        "--data.chat_template",
        "off",
        "--data.max_prompt_len",
        "16",
        "--rollout.max_new_tokens",
        "4",
        "--rollout.n",
        "8",
        "--train.prompts_per_step",
        "16",
        "--train.minibatches",
        "1",
        "--train.lr",
        str(args.lr),
        "--train.steps",
        str(args.steps),
        "--train.max_minutes",
        "0",
        "--log.eval_every",
        "25",
        "--ckpt.every",
        "0",
        "--log.progress",
        "false",
        "--log.run_dir",
        str(run_dir),
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "output.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
            tail = (run_dir / "output.log").read_text().strip().splitlines()[-1:]
            raise SystemExit(
                f"hybridrl train ({dtype}) failed: {tail[0] if tail else '?'} (all of it: {run_dir}/output.log)"
            )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(runs: dict[str, list[dict]], steps: int) -> dict:
    """Per dtype: held-out accuracy at every 25th step with the mean reward and entropy of the 25 steps
    after it, the median seconds per step by phase, and the mean trainer/vLLM log-prob gap."""
    out = {"windows": {}, "phases_s": {}, "logp_gap": {}}
    for d, rows in runs.items():
        out["windows"][d] = []
        for start in range(0, steps + 1, 25):
            acc = next((r["heldout_acc"] for r in rows if r.get("step") == start and "heldout_acc" in r), None)
            window = [r for r in rows if "reward" in r and start < r["step"] <= start + 25]
            out["windows"][d].append(
                {
                    "step": start,
                    "heldout": acc,
                    "reward": statistics.mean(r["reward"] for r in window) if window else None,
                    "entropy": statistics.mean(r["entropy_mean"] for r in window) if window else None,
                }
            )
        steps_ = [r for r in rows if "reward" in r]
        out["phases_s"][d] = {
            k[5:]: statistics.median(r[k] for r in steps_ if k in r)
            for k in ("time/train", "time/generate", "time/sync")
        }
        out["logp_gap"][d] = statistics.mean(r["logp_gap_mean"] for r in steps_ if "logp_gap_mean" in r)
    return out


def table(s: dict) -> str:
    runs = s["windows"]
    lines = ["step     " + "".join(f"{d + ' held-out':>19}{'reward':>9}{'entropy':>9}" for d in runs)]
    for i, w in enumerate(next(iter(runs.values()))):
        cells = ""
        for windows in runs.values():
            acc, rew, ent = windows[i]["heldout"], windows[i]["reward"], windows[i]["entropy"]
            cells += (
                f"{(f'{acc:.1%}' if acc is not None else ''):>19}{(f'{rew:.3f}' if rew is not None else ''):>9}"
                f"{(f'{ent:.3f}' if ent is not None else ''):>9}"
            )
        lines.append(f"{w['step']:<9}" + cells)
    lines.append(
        "(held-out: greedy, the demo's 256 prompts, at that step; reward and entropy: mean of the 25 steps after it)"
    )
    for d in runs:
        lines.append(
            f"{d}: median s/step by phase "
            + ", ".join(f"{k} {v:.2f}" for k, v in s["phases_s"][d].items())
            + f"; mean trainer/vLLM log-prob gap {s['logp_gap'][d]:.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    from hybridrl.core import environ

    environ.setup()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="134m", choices=[s for s in shapes.SHAPES if s != "tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--start-acc", type=float, default=0.3, help="warm-up until this greedy held-out accuracy")
    ap.add_argument("--out", default="runs/learn_scale")
    args = ap.parse_args()
    model = warm_up(args.shape, args.start_acc)
    runs, wall = {}, {}
    for dtype in args.dtypes:
        t = time.perf_counter()
        runs[dtype] = train(model, dtype, args)
        wall[dtype] = time.perf_counter() - t
        print(f"{dtype}: {args.steps} steps in {wall[dtype]:.0f} s", flush=True)
    print(
        f"\n{args.shape} ({shapes.n_params(model) / 1e6:.1f}M parameters) warmed up on addition, then GRPO "
        f"(16 prompts x 8, <= 4 tokens, lr {args.lr:g}); {shapes.describe_machine()}\n"
    )
    s = summary(runs, args.steps)
    print(table(s))
    record(
        "learn_scale",
        {
            "shape": args.shape,
            "params": shapes.n_params(model),
            "dtypes": args.dtypes,
            "steps": args.steps,
            "lr": args.lr,
            "start_acc": args.start_acc,
            "prompts": 16,
            "n": 8,
            "tokens": 4,
        },
        {**s, "wall_s": wall},
    )


if __name__ == "__main__":
    main()
