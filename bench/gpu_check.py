"""The GPU self-check: every GPU claim hybridrl makes, measured in one command.

    make gpu-check                                   # = python -m bench.gpu_check
    python -m bench.gpu_check --only sleep,kernels   # some checks (names below)
    python -m bench.gpu_check --list                 # the claims, without running anything

Prints one row per claim (what was measured, the figure, the target, pass/fail) and records
every row at the end (bench/results/gpu_check.jsonl, one line per run; `--out FILE` also writes
them to FILE as JSON after each check, so a run cut short keeps what it measured). Each check runs
in its own process, so one that crashes or hangs (killed at its timeout) costs its rows only; its
error is in the row. Without CUDA the GPU rows print `unmeasured (no CUDA)` and it exits 0;
with CUDA it exits 1 if a row failed.

Checks (in order; the first six drive the engines in process, gpu_engine_checks.py; the rest run
`hybridrl train` as a user does, gpu_run_checks.py; gpu_claims.py lists every row):
  stack       versions of torch, CUDA, vLLM, DeepSpeed, Triton, Liger, transformers; the device
  expandable  expandable segments set for training, off inside vLLM's pool (run-time toggle), and a
              fragmentation case that runs out of memory without them and fits with them
  kernels     fused log-prob + loss (Triton, chunked torch) vs naive full logits vs Liger at
              N=16384, d=896, V=151936, bf16: time, peak extra memory, and correctness vs fp32
  offload     DeepSpeed offload/reload of the trainer (ZeRO-2/3, with and without parameters) at
              the Qwen2.5-0.5B shape: bytes out and back, seconds, next steps' loss unchanged
  sleep       vLLM sleep levels 1 and 2 (0.5B shape): memory freed, sleep and wake latency, weights
              then KV cache, the same greedy tokens after a level-2 sleep and a full hand-off
  planner     gpu_memory_utilization=auto: vLLM's footprint vs the planned budget, and a whole
              cycle (generate, sleep, reload, train, hand-off, wake) at that plan without OOM
  e2e         the demo (held-out before/after), 20 steps of the 0.5B shape with 256-token
              completions (phases, memory timeline, hybrid overhead, probe gap), sleep level 2 vs 1
  oop         the out-of-process hand-off (CUDA IPC buckets): the demo and the 0.5B shape
  critic      PPO with a critic (gae) plus checkpoints
  variants    0.5B: this memory plan vs the previous one, CUDA graphs vs eager decoding
  paths       the demo with a KL term through the reference's device copy, LoRA and ZeRO-3: KL 0 at
              step 1, vLLM's log-probs equal to the trainer's after every hand-off

The 0.5B model is built from Qwen2.5-0.5B's config with random weights (no download) and the
demo's tokenizer; its completions decode to little text, so those runs train on every sample
(algo.skip_zero_advantage=false) with a hash reward: the arithmetic is a real run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import gpu_engine_checks as engine, gpu_run_checks as runs
from bench.gpu_claims import CLAIMS, ROOT, UNMEASURED
from bench.results import record

# check name -> the function that measures it, in the order they run (CLAIMS lists their rows)
CHECKS = {
    "stack": engine.check_stack,
    "expandable": engine.check_expandable,
    "kernels": engine.check_kernels,
    "offload": engine.check_offload,
    "sleep": engine.check_sleep,
    "planner": engine.check_planner,
    "e2e": runs.check_e2e,
    "oop": runs.check_oop,
    "critic": runs.check_critic,
    "variants": runs.check_variants,
    "paths": runs.check_paths,
    "tp": runs.check_tp,
}


# --- the driver ------------------------------------------------------------------------------------
def run_check(name: str, cuda: bool, log_dir: Path | None) -> list[dict]:
    timeout, claims = CLAIMS[name]
    if not cuda and name != "stack":
        return [
            {"check": name, "claim": c, "value": UNMEASURED, "target": t, "verdict": "unmeasured", "data": {}}
            for c, t in claims
        ]
    t = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.gpu_check", "--check", name],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
        stdout, stderr, rc = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = f"timeout after {timeout} s"
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{name}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    rows = [json.loads(x[4:]) for x in stdout.splitlines() if x.startswith("ROW ")]
    if rc != 0:
        tail = " | ".join([x for x in stderr.splitlines() if x.strip()][-4:])[-600:]
        rows.append(
            {
                "claim": f"{name}: check process",
                "value": f"exit {rc}: {tail}",
                "target": "exit 0",
                "verdict": "fail",
                "data": {"stderr_tail": stderr[-6000:]},
            }
        )
    for r in rows:
        r["check"] = name
    rows.append(
        {
            "check": name,
            "claim": f"{name}: wall time",
            "value": f"{time.perf_counter() - t:.0f} s",
            "target": "",
            "verdict": "info",
            "data": {},
        }
    )
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| check | claim | measured | target | verdict |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.get('check', '')} | {r['claim']} | {r['value']} | {r['target']} | {r['verdict']} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated checks ({', '.join(CHECKS)})")
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file after each check")
    ap.add_argument("--log-dir", default=None, help="each check's full output goes here")
    ap.add_argument("--list", action="store_true", help="print the claims and exit")
    ap.add_argument("--check", help=argparse.SUPPRESS)
    ap.add_argument("--fragment", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from hybridrl.core import environ

    environ.setup()
    cuda = environ.has_cuda()
    if a.fragment:
        engine.fragment()
        return 0
    if a.check:
        CHECKS[a.check](cuda)
        return 0
    names = [n for n in a.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if a.list:
        print_rows(
            [{"check": n, "claim": c, "value": "", "target": t, "verdict": ""} for n in names for c, t in CLAIMS[n][1]]
        )
        return 0
    if cuda and a.check is None:
        half_b_model_in_child = subprocess.run(
            [sys.executable, "-c", "from bench import gpu_claims; print(gpu_claims.half_b_model())"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if half_b_model_in_child.returncode:
            print("could not build the 0.5B model:", half_b_model_in_child.stderr[-2000:], file=sys.stderr)
    out = Path(a.out) if a.out else None
    rows: list[dict] = []
    for name in names:
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        rows += run_check(name, cuda, Path(a.log_dir) if a.log_dir else None)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(
                json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "cuda": cuda, "rows": rows}, indent=1, default=str)
            )
    print()
    print_rows(rows)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "fail", "unmeasured")}
    print(
        f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['unmeasured']} unmeasured"
        + (f"; rows in {out}" if out else "")
    )
    record(
        "gpu_check",
        {"checks": names, "cuda": cuda},
        {"rows": rows, "passed": counts["pass"], "failed": counts["fail"], "unmeasured": counts["unmeasured"]},
    )
    return 1 if cuda and any(r["verdict"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
