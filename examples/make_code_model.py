"""Build `hybridrl/demo_model_code/`: a tiny model warmed up to write short Python functions.

The task is `hybridrl.data.tasks.code`: "f(0)=3;f(1)=7;" -> "def f(x):return 4*x+3". Like the demo
model (examples/make_demo_model.py, whose tokenizer, model and loss this reuses): a character-level
tokenizer (the task's characters; a space is byte-level "Ġ"), a Qwen2ForCausalLM of hidden 128 and
4 heads of 32, fp32, warmed up with supervised loss on the TRAIN split's programs, evaluated every
`--eval-every` steps by greedy decoding of the held-out prompts, and stopped at the first evaluation
where 20-30% of held-out functions are right (a program `def f(x):return A*x+B` with the right A and
B: what passing all five tests takes for this model's programs). After saving, the held-out greedy
programs run through the code_tests reward in the sandbox, and their pass rate is written with the
warm-up's figures to warmup.json.

Deterministic (fixed seed, one thread): two runs give the same weights. A few minutes on 2 cores.

Run:  python examples/make_code_model.py [--out hybridrl/demo_model_code]
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_model as base  # noqa: E402

from hybridrl.data.tasks import code  # noqa: E402

CHARS = list("0123456789+=;*():defnrtux") + ["Ġ"]  # byte-level's space
BAND = (0.20, 0.30)
PROGRAM = re.compile(r"def f\(x\):return (\d+)\*x\+(\d+)")


def rows_with_programs(split: str) -> list[dict]:
    return [{**r, "answer": code.program_text(*code.coefficients(r["prompt"]))} for r in code.load(split)]


def right(prompt: str, program: str) -> bool:
    m = PROGRAM.fullmatch(program.strip())
    return bool(m) and (int(m[1]), int(m[2])) == code.coefficients(prompt)


def evaluate(model, tokenizer, rows, encoded) -> tuple[float, list[str]]:
    model.eval()
    outs = base.greedy_decode(model, [p for p, _ in encoded], tokenizer.eos_token_id, code.MAX_NEW_TOKENS)
    model.train()
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    return sum(right(r["prompt"], t) for r, t in zip(rows, texts)) / len(rows), texts


def main() -> None:
    ap = base.warmup_args(__doc__, code.MODEL_DIR, 3000)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    base.deterministic(args.seed)
    tokenizer = base.build_tokenizer(CHARS)
    sample = "f(0)=3;f(1)=7;def f(x):return 4*x+3"
    assert tokenizer.decode(tokenizer(sample, add_special_tokens=False).input_ids) == sample
    model = base.build_model(tokenizer)
    train = base.encode_rows(tokenizer, rows_with_programs("train"))
    held_rows = rows_with_programs("heldout")
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
        acc, texts = evaluate(model, tokenizer, held_rows, held)
        trajectory.append({"step": step, "loss": round(loss, 4), "heldout_right": acc})
        print(f"step {step:4d}  loss {loss:.4f}  held-out right {acc:.3f}  e.g. {texts[0]!r}", flush=True)
        if acc >= BAND[0]:
            if acc > BAND[1]:
                raise RuntimeError(f"held-out jumped past the band to {acc:.3f}; lower --lr or --eval-every")
            break
    else:
        raise RuntimeError(f"held-out never reached {BAND[0]} in {args.max_steps} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    base.save_tokenizer(tokenizer, args.out)
    from hybridrl.data import code_tests

    def spec(r):
        return json.dumps({"code_tests": code_tests.spec_of(r)})

    scores = [code_tests.code_tests(r["prompt"], t, spec(r)) for r, t in zip(held_rows, texts)]
    final = trajectory[-1]
    info = {
        "seed": args.seed,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": final["step"],
        "heldout_right": final["heldout_right"],
        "heldout_pass_all": sum(s == 1.0 for s in scores) / len(scores),
        "heldout_mean_reward": round(sum(scores) / len(scores), 4),
        "torch": torch.__version__,
        "trajectory": {k: [t[k] for t in trajectory] for k in trajectory[0]},
    }
    text = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in info.items())
    (args.out / "warmup.json").write_text("{\n" + text + "\n}\n")
    print(
        f"saved to {args.out}: {json.dumps({k: v for k, v in info.items() if k != 'trajectory'})}, "
        f"{time.time() - t0:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
