"""The learning curve is the benchmark: held-out accuracy vs wall time on the demo, per seed.

    python -m bench.demo_curve                    # 3 seeds x 2.5 minutes, the default recipe
    python -m bench.demo_curve --seeds 0 --minutes 2 --set train.lr=3e-5
    python -m bench.demo_curve --reuse --out runs/demo_curve   # the table again, from the runs made

Each seed is a full `hybridrl train` run (its own process, engines started fresh) with a wall
budget of --minutes counted from engine start, evaluating the fixed 256-prompt held-out split
greedily every ~10 s. Prints accuracy vs time, time to 50% and to 75%, and seconds per step
split by phase; records them (bench/results/demo_curve.jsonl, each seed's evaluations too) and
writes demo_curve.png (and the raw runs) to --out.
Target: 75% held-out accuracy within 2 minutes of engine start (time to 75%, mean of 3 seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.results import record


def run_seed(seed: int, args) -> dict:
    run_dir = Path(args.out) / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--train.seed",
        str(seed),
        "--steps",
        "100000",
        "--train.max_minutes",
        str(args.minutes),
        "--log.eval_every",
        "0",
        "--log.eval_every_s",
        str(args.eval_every_s),
        "--log.run_dir",
        str(run_dir),
        *sum((["--set", s] for s in args.set), []),
    ]
    if not (args.reuse and (run_dir / "metrics.jsonl").exists()):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, elapsed = [], 0.0
    for r in rows:  # an evaluation follows the step record it belongs to
        if "elapsed_s" in r:
            elapsed = r["elapsed_s"]
        if "heldout_acc" in r:
            curve.append((elapsed, r["heldout_acc"]))
    steps = [r for r in rows if "reward" in r]
    phases = sorted({k for r in steps for k in r if k.startswith("time/")})
    return {
        "curve": curve,
        "steps": len(steps),
        "phases": {k[5:]: statistics.median(r.get(k, 0.0) for r in steps[3:]) for k in phases},
    }


def time_to(curve, target: float):
    return next((t for t, acc in curve if acc >= target), None)


def acc_at(curve, t: float) -> float:
    """Accuracy of the last evaluation at or before time t."""
    before = [acc for s, acc in curve if s <= t + 1e-9]
    return before[-1] if before else (curve[0][1] if curve else 0.0)


def main() -> None:
    from hybridrl.core import environ

    environ.setup()  # matplotlib's and the engines' caches go under the project's cache dir, not ~/.cache
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=2.5)
    ap.add_argument("--eval-every-s", type=float, default=10.0)
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. train.lr=3e-5")
    ap.add_argument("--out", default="runs/demo_curve")
    ap.add_argument(
        "--reuse", action="store_true", help="tabulate the seeds already run under --out instead of running them again"
    )
    args = ap.parse_args()

    results = {}
    for seed in args.seeds:
        results[seed] = run_seed(seed, args)
        r = results[seed]
        print(f"seed {seed}: {r['steps']} steps, final held-out {r['curve'][-1][1]:.1%}", flush=True)

    grid = list(range(0, int(args.minutes * 60) + 1, int(args.eval_every_s)))
    print(f"\nheld-out greedy accuracy vs wall time after engine start (overrides: {args.set or 'none'})\n")
    print(f"{'t (s)':>6}" + "".join(f"{'seed ' + str(s):>10}" for s in args.seeds) + f"{'mean':>10}")
    for t in grid:
        accs = [acc_at(results[s]["curve"], t) for s in args.seeds]
        print(f"{t:>6}" + "".join(f"{a:>10.1%}" for a in accs) + f"{statistics.mean(accs):>10.1%}")
    finals = [results[s]["curve"][-1][1] for s in args.seeds]
    print(f"{'final':>6}" + "".join(f"{a:>10.1%}" for a in finals) + f"{statistics.mean(finals):>10.1%}")
    for target in (0.5, 0.75):
        times = [time_to(results[s]["curve"], target) for s in args.seeds]
        cells = "".join(f"{('%.0f s' % t) if t is not None else 'not reached':>13}" for t in times)
        print(f"time to {target:.0%}: {cells}")
    phases = {k: statistics.mean(results[s]["phases"][k] for s in args.seeds) for k in results[args.seeds[0]]["phases"]}
    total = sum(phases.values())
    print(
        "\nseconds per step by phase (median per seed, mean over seeds): "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items() if v >= 5e-4)
        + f"; total {total * 1000:.0f} ms"
    )
    reached = [time_to(results[s]["curve"], 0.75) for s in args.seeds]
    mean75 = f"{statistics.mean(reached):.0f} s" if None not in reached else "not reached by every seed"
    print(f"mean final accuracy {statistics.mean(finals):.1%}; mean time to 75%: {mean75} (target <= 120 s)")
    seeds = [str(s) for s in args.seeds]
    record(
        "demo_curve",
        {"seeds": args.seeds, "minutes": args.minutes, "eval_every_s": args.eval_every_s, "set": args.set},
        {
            "grid_s": grid,
            "acc": {str(s): [acc_at(results[s]["curve"], t) for t in grid] for s in args.seeds},
            "mean": [statistics.mean(acc_at(results[s]["curve"], t) for s in args.seeds) for t in grid],
            "final": dict(zip(seeds, finals)),
            "final_mean": statistics.mean(finals),
            "time_to_50": {str(s): time_to(results[s]["curve"], 0.5) for s in args.seeds},
            "time_to_75": dict(zip(seeds, reached)),
            "mean_time_to_75": statistics.mean(reached) if None not in reached else None,
            "steps": {str(s): results[s]["steps"] for s in args.seeds},
            "phases_ms": {k: v * 1000 for k, v in phases.items()},
            "step_ms": total * 1000,
            "curves": {str(s): results[s]["curve"] for s in args.seeds},
        },
    )
    plot(results, args)


def plot(results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, r in results.items():
        t, acc = zip(*r["curve"])
        ax.plot(t, [a * 100 for a in acc], marker="o", ms=3, label=f"seed {seed}")
    ax.axhline(75, color="gray", ls="--", lw=1)
    ax.set(
        xlabel="wall time after engine start (s)",
        ylabel="held-out greedy accuracy (%)",
        title="hybridrl demo: GRPO on two-number addition (2 CPU cores)",
    )
    ax.legend()
    fig.tight_layout()
    out = Path(args.out) / "demo_curve.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
