"""Where one RL step's time goes, and how the loop's rollout compares with vLLM alone.

    python -m bench.step                 # the demo, 40 steps, on this machine
    python -m bench.step --steps 60 --set train.prompts_per_step=64

Three measurements in one run, each in its own process so the engines do not share state:
  1. the hybridrl loop (`hybridrl train`): per-phase medians from its metrics.jsonl;
  2. a standalone vLLM engine with the same settings, generating the same prompt batches;
  3. transformers `generate` on the same prompts (left padding, sampling, same n and length).
Targets (issue 2): loop rollout >= 0.95x standalone vLLM; hand-off (sync) <= 5% of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import record
from bench.scale import prompt_batches  # the loop's prompt batches: one home, bench/scale.py

ROOT = Path(__file__).resolve().parents[1]


def standalone(cfg, steps: int) -> dict:
    """vLLM alone, built with the loop's settings (hybridrl.engines.rollout.Rollout without a trainer)."""
    from hybridrl.core import launch
    from hybridrl.engines.rollout import Rollout

    launch.init_distributed()
    cfg, path, tok, batches = prompt_batches(cfg, steps)
    ro = Rollout(cfg, path, on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    rates = []
    for prompts in batches:
        t = time.perf_counter()
        samples = [
            s
            for done in ro.generate(
                prompts,
                cfg.rollout.n,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                max_tokens=cfg.rollout.max_new_tokens,
            )
            for s in done
        ]
        rates.append(sum(len(s.token_ids) for s in samples) / (time.perf_counter() - t))
    return {"tok_s": statistics.median(rates[3:])}


def hf_generate(cfg, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    cfg, path, tok, batches = prompt_batches(cfg, steps)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok.padding_side = "left"
    rates = []
    for prompts in batches[: max(6, steps // 4)]:
        enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                num_return_sequences=cfg.rollout.n,
                max_new_tokens=cfg.rollout.max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        gen = out[:, enc["input_ids"].shape[1] :]
        # tokens up to and including the first eos, as vLLM counts them
        n_tok = sum(
            int(((row == tok.eos_token_id).cumsum(0) == 0).sum()) + int((row == tok.eos_token_id).any()) for row in gen
        )
        rates.append(n_tok / (time.perf_counter() - t))
    return {"tok_s": statistics.median(rates[2:])}


def loop_run(args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-step-"))
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--steps",
        str(args.steps),
        "--log.eval_every",
        "0",
        "--log.run_dir",
        str(run_dir),
        *sum((["--set", s] for s in args.set), []),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = [r for r in rows if "reward" in r][3:]  # skip warm-up steps
    phases = sorted({k for r in steps for k in r if k.startswith("time/")})
    med = {k[5:]: statistics.median(r.get(k, 0.0) for r in steps) for k in phases}  # probe: every 20 steps
    return {
        "phases": med,
        "tok_s": statistics.median(r["rollout_tok_s"] for r in steps),
        "train_tok_s": statistics.median(r["train_tok_s"] for r in steps),
        "step_s": statistics.median(sum(r.get(k, 0.0) for k in phases) for r in steps),
    }


def _child(part: str, args) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.step",
            "--part",
            part,
            "--steps",
            str(args.steps),
            *sum((["--set", s] for s in args.set), []),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. train.prompts_per_step=64")
    ap.add_argument("--part", choices=["standalone", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    from hybridrl.core import config, environ

    environ.setup()
    if args.part:
        cfg = config.load(None, dict(s.split("=", 1) for s in args.set))
        print(json.dumps((standalone if args.part == "standalone" else hf_generate)(cfg, args.steps)))
        return

    loop = loop_run(args)
    alone = _child("standalone", args)
    hf = _child("hf", args)
    step_ms = loop["step_s"] * 1000
    print(
        f"\nhybridrl step benchmark: demo model, {args.steps} steps, overrides {args.set or 'none'} "
        f"(medians after 3 warm-up steps)\n"
    )
    print(f"{'phase':<12}{'ms':>10}{'% of step':>12}")
    for name, sec in loop["phases"].items():
        print(f"{name:<12}{sec * 1000:>10.1f}{sec * 1000 / step_ms:>12.1%}")
    print(f"{'step':<12}{step_ms:>10.1f}{1:>12.0%}\n")
    print(f"{'rollout':<28}{'tok/s':>10}{'vs standalone':>16}")
    for name, rate in (
        ("hybridrl loop (vLLM)", loop["tok_s"]),
        ("standalone vLLM", alone["tok_s"]),
        ("transformers generate", hf["tok_s"]),
    ):
        print(f"{name:<28}{rate:>10.0f}{rate / alone['tok_s']:>15.2f}x")
    print(f"\ntrain tokens/s: {loop['train_tok_s']:.0f}")
    sync = loop["phases"].get("sync", 0.0) / loop["step_s"]
    print(f"targets: loop/standalone {loop['tok_s'] / alone['tok_s']:.2f} (>= 0.95), sync {sync:.1%} of step (<= 5%)")
    record(
        "step",
        {"model": "demo", "steps": args.steps, "warmup": 3, "set": args.set},
        {
            "phases_ms": {k: v * 1000 for k, v in loop["phases"].items()},
            "step_ms": step_ms,
            "rollout_tok_s": {
                "hybridrl loop (vLLM)": loop["tok_s"],
                "standalone vLLM": alone["tok_s"],
                "transformers generate": hf["tok_s"],
            },
            "loop_vs_standalone": loop["tok_s"] / alone["tok_s"],
            "train_tok_s": loop["train_tok_s"],
            "sync_share": sync,
        },
    )


if __name__ == "__main__":
    main()
