"""On-policy distillation against GRPO on the demo: held-out accuracy against steps and wall time.

    python -m bench.distill                          # teacher made here, 3 seeds x 300 steps each way
    python -m bench.distill --teacher DIR --seeds 0 --steps 150
    python -m bench.distill --reuse --out runs/distill   # the table again, from the runs made

The teacher is the demo model after the default GRPO run (600 steps, seed 0: ~85% held-out),
exported (`hybridrl export`); it is made once under --out unless --teacher names one. The student in
both arms is the shipped demo model (~20% held-out). Each arm and seed is one `hybridrl train` run
(its own process, engines started fresh) on the demo's recipe, the same except for
`--algo.teacher`: the distillation arm has no task reward (pure distillation: the advantage is
-algo.distill_coef * d_t, d_t the teacher's per-token reverse KL), GRPO has the exact verifier's.
Both evaluate the fixed 256-prompt held-out split greedily every --eval-every steps. Prints accuracy
against steps (mean of the seeds) and each arm's steps and seconds to reach 50% and 75% and the
teacher's accuracy less 5 points, and the teacher phase's share of a distillation step; records
them in bench/results/distill.jsonl. Runs one at a time: on a 2-core machine side by side they
would time each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.results import record


def train(run_dir: Path, *flags: str, reuse: bool) -> list[dict]:
    if not (reuse and (run_dir / "metrics.jsonl").exists()):
        cmd = [sys.executable, "-m", "hybridrl", "train", "--log.run_dir", str(run_dir), *flags]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, seconds after engine start, held-out accuracy) of every evaluation."""
    out, elapsed = [], 0.0
    for r in rows:  # an evaluation follows the step record it belongs to
        if "elapsed_s" in r:
            elapsed = r["elapsed_s"]
        if "heldout_acc" in r:
            out.append((r["step"], elapsed if r["step"] else 0.0, r["heldout_acc"]))
    return out


def reach(c: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    return next(((s, t) for s, t, acc in c if acc >= target), None)


def shown(path: Path) -> str:
    """A path as the results record it: relative to the working directory where it lies under it (no
    machine's absolute paths in bench/results)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def make_teacher(out: Path, reuse: bool) -> tuple[Path, float]:
    """The demo after the default GRPO run, exported: (its directory, its final held-out accuracy)."""
    rows = train(out / "teacher_run", "--train.seed", "0", reuse=reuse)
    acc = next(r["summary"]["heldout_acc_after"] for r in reversed(rows) if "summary" in r)
    model = out / "teacher"
    if not (reuse and (model / "config.json").exists()):
        subprocess.run(
            [sys.executable, "-m", "hybridrl", "export", str(out / "teacher_run"), str(model)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return model, acc


def main() -> None:
    from hybridrl.core import environ

    environ.setup()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--teacher", default="", help="a teacher model directory (default: made under --out)")
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--reuse", action="store_true", help="tabulate the runs already under --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.teacher:
        teacher, teacher_acc = Path(args.teacher), None
    else:
        teacher, teacher_acc = make_teacher(out, args.reuse)
        print(f"teacher: {teacher} (held-out {teacher_acc:.1%} after the default GRPO run)", flush=True)
    common = ["--steps", str(args.steps), "--log.eval_every", str(args.eval_every), "--train.max_minutes", "0"]
    arms = {"distill": ["--algo.teacher", str(teacher)], "grpo": []}
    runs: dict[str, dict[int, list[dict]]] = {arm: {} for arm in arms}
    for seed in args.seeds:
        for arm, flags in arms.items():
            rows = train(out / f"{arm}{seed}", *common, "--train.seed", str(seed), *flags, reuse=args.reuse)
            runs[arm][seed] = rows
            print(f"{arm} seed {seed}: held-out {curve(rows)[0][2]:.1%} -> {curve(rows)[-1][2]:.1%}", flush=True)

    curves = {arm: {s: curve(rows) for s, rows in by_seed.items()} for arm, by_seed in runs.items()}
    steps = [s for s, _, _ in curves["grpo"][args.seeds[0]]]
    print(f"\nheld-out greedy accuracy against steps, mean of seeds {args.seeds} (demo student, 2 CPU cores)\n")
    print(f"{'step':>6}{'distill':>10}{'grpo':>10}{'distill s':>11}{'grpo s':>9}")
    table = []
    for i, step in enumerate(steps):
        acc = {a: statistics.mean(curves[a][s][i][2] for s in args.seeds) for a in arms}
        sec = {a: statistics.mean(curves[a][s][i][1] for s in args.seeds) for a in arms}
        table.append({"step": step, **{f"{a}_acc": acc[a] for a in arms}, **{f"{a}_s": sec[a] for a in arms}})
        print(f"{step:>6}{acc['distill']:>10.1%}{acc['grpo']:>10.1%}{sec['distill']:>11.0f}{sec['grpo']:>9.0f}")
    targets = {"50%": 0.5, "75%": 0.75}
    if teacher_acc is not None:
        targets[f"teacher - 5 ({teacher_acc - 0.05:.0%})"] = teacher_acc - 0.05
    reached = {}
    for name, target in targets.items():
        for arm in arms:
            hits = [reach(curves[arm][s], target) for s in args.seeds]
            reached[f"{arm} {name}"] = hits
            cells = ", ".join(f"step {h[0]} / {h[1]:.0f} s" if h else "not reached" for h in hits)
            print(f"{arm:>8} to {name}: {cells}")
    share = [
        statistics.median(
            r["time/teacher"] / max(sum(v for k, v in r.items() if k.startswith("time/")), 1e-9)
            for r in rows
            if "time/teacher" in r
        )
        for rows in runs["distill"].values()
    ]
    step_ms = {
        arm: statistics.mean(
            statistics.median(sum(v for k, v in r.items() if k.startswith("time/")) for r in rows if "reward" in r)
            for rows in by_seed.values()
        )
        * 1000
        for arm, by_seed in runs.items()
    }
    print(
        f"\nteacher phase: {statistics.mean(share):.0%} of a distillation step (median per seed, mean); "
        f"step {step_ms['distill']:.0f} ms distilling, {step_ms['grpo']:.0f} ms GRPO"
    )
    record(
        "distill",
        {"seeds": args.seeds, "steps": args.steps, "eval_every": args.eval_every, "teacher": shown(teacher)},
        {
            "teacher_acc": teacher_acc,
            "table": table,
            "reached": {k: [list(h) if h else None for h in v] for k, v in reached.items()},
            "teacher_share": statistics.mean(share),
            "step_ms": step_ms,
            "curves": {a: {str(s): c for s, c in by.items()} for a, by in curves.items()},
        },
    )


if __name__ == "__main__":
    main()
