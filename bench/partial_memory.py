"""Partial rollouts' host memory over a long run: what vLLM still holds after each step's abort, and
the trainer process's resident memory, step by step.

Each step of `--rollout.partial on` aborts the groups still generating once enough are complete.
vLLM's output processor kept every aborted n > 1 group's parent request (with the finished
siblings' outputs) until vllm_compat dropped it (issue 59): held requests then grew by the groups cut
per step, for the whole run. `partial/vllm_requests_held` is what vLLM holds right after the abort
(0 when nothing leaks); `host/rss_gb` the process's resident memory at the end of the step's phases.

    python -m bench.partial_memory                    # 200 steps of the long-tail task, this tree
    python -m bench.partial_memory --tree ../old      # the same run from another checkout (same venv)

One row per run in bench/results/partial_memory.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--data.path",
    "longtail",
    "--rollout.partial",
    "on",
    "--train.prompts_per_step",
    "16",
    "--train.minibatches",
    "1",
    "--log.eval_every",
    "0",
    "--train.max_minutes",
    "0",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose hybridrl runs (its root is the cwd)")
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "hybridrl",
            "train",
            *FLAGS,
            "--steps",
            str(args.steps),
            "--log.run_dir",
            str(run_dir),
            *extra,
        ]
        res = subprocess.run(cmd, cwd=args.tree, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    marks = sorted({1, 10, *range(50, args.steps + 1, 50), steps[-1]["step"]})
    at = {r["step"]: r for r in steps}
    print(f"{'step':>5} {'held by vLLM':>13} {'aborted samples':>16} {'host RSS GiB':>13}")
    table = []
    for k in marks:
        r = at[k]
        held = r.get("partial/vllm_requests_held")
        table.append(
            {"step": k, "held": held, "aborted": r.get("partial/aborted_samples"), "rss_gb": round(r["host/rss_gb"], 3)}
        )
        print(
            f"{k:>5} {'-' if held is None else int(held):>13} {int(r.get('partial/aborted_samples', 0)):>16} "
            f"{r['host/rss_gb']:>13.3f}"
        )
    aborted = sum(r.get("partial/aborted_samples", 0) for r in steps)
    growth = steps[-1]["host/rss_gb"] - at[min(10, steps[-1]["step"])]["host/rss_gb"]
    print(
        f"aborted samples in all: {int(aborted)}; host RSS from step 10 to {steps[-1]['step']}: "
        f"{growth * 1024:+.0f} MiB"
    )
    tree = Path(args.tree).resolve()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    record(
        "partial_memory",
        {"steps": args.steps, "flags": FLAGS + extra, "tree_commit": head},
        {"table": table, "aborted_samples": aborted, "rss_growth_mib": round(growth * 1024, 1)},
    )


if __name__ == "__main__":
    main()
