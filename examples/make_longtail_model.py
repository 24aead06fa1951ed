"""Build `hybridrl/demo_model_longtail/`: the demo model warmed on the long-tailed task.

Starts from the shipped demo model (hybridrl/demo_model: addition, ~22% held-out) and fine-tunes it,
with the same supervised loss as examples/make_demo_model.py, on the TRAIN split of
`hybridrl.data.tasks.longtail` (the sum written 1 + b mod 20 times where a is a multiple of 4). It
stops at the first evaluation where greedy decoding repeats (answers longer than 8 tokens) on at
least half of the held-out prompts that ask for repeats: the model has half learnt the rule, so
sampling from it gives lengths from 2 tokens to the 48-token limit, the long tail partial
rollouts are for. Deterministic (fixed seed, one thread): two runs give the same weights.

Run:  python examples/make_longtail_model.py [--out hybridrl/demo_model_longtail]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_model as base  # noqa: E402

from hybridrl.data.tasks import arithmetic, longtail  # noqa: E402

LONG = 8  # tokens: an answer longer than this repeats the sum


def evaluate(model, tokenizer, rows, encoded) -> dict:
    eos = tokenizer.eos_token_id
    model.eval()
    outs = base.greedy_decode(model, [p for p, _ in encoded], eos, max_new_tokens=longtail.MAX_NEW_TOKENS)
    model.train()
    asks = [r["answer"] != str(sum(int(x) for x in r["prompt"].rstrip("=").split("+"))) for r in rows]
    long = [len(o) > LONG for o in outs]
    correct = [
        arithmetic.verify(tokenizer.decode(o, skip_special_tokens=True), r["answer"]) for r, o in zip(rows, outs)
    ]
    return {
        "acc": sum(correct) / len(rows),
        "repeat_share": sum(lg for lg, a in zip(long, asks) if a) / max(sum(asks), 1),
        "mean_len": sum(len(o) for o in outs) / len(outs),
    }


def main() -> None:
    ap = base.warmup_args(__doc__, longtail.MODEL_DIR, 2000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-size", type=int, default=64, help="held-out prompts evaluated (every k-th row)")
    args = ap.parse_args()
    t0 = time.time()
    base.deterministic(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(arithmetic.DEMO_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(arithmetic.DEMO_MODEL_DIR, dtype=torch.float32)
    train = base.encode_rows(tokenizer, longtail.load("train"))
    held_rows = longtail.load("heldout")
    held_rows = held_rows[:: max(1, len(held_rows) // args.eval_size)]  # greedy to 48 tokens is the slow part
    held = base.encode_rows(tokenizer, held_rows)
    trajectory = []
    for step, loss in base.sft_steps(
        model,
        tokenizer,
        train,
        seed=args.seed,
        lr=args.lr,
        batch_size=args.batch_size,
        max_steps=args.max_steps,
        every=args.eval_every,
    ):
        ev = evaluate(model, tokenizer, held_rows, held)
        trajectory.append({"step": step, "loss": round(loss, 4), **ev})
        print(f"step {step:4d}  loss {loss:.4f}  {ev}", flush=True)
        if ev["repeat_share"] >= 0.5:
            break
    else:
        raise RuntimeError(f"greedy answers never repeated on half the prompts in {args.max_steps} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (arithmetic.DEMO_MODEL_DIR / f).exists():
            shutil.copy(arithmetic.DEMO_MODEL_DIR / f, args.out / f)
    info = {
        "from": "hybridrl/demo_model",
        "seed": args.seed,
        "lr": args.lr,
        "batch_size": args.batch_size,
        **trajectory[-1],
        "torch": torch.__version__,
        "trajectory": trajectory,
    }
    (args.out / "warmup.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"saved to {args.out}: {trajectory[-1]}, {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
