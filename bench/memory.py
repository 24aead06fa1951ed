"""The hybrid engine's memory life cycle, measured: what sleep frees, how long waking takes, what
the hand-off costs in process vs out of process (per parameter vs bucketed), peak memory per
phase with and without expandable segments, and the step time.

    python -m bench.memory                       # GPU: a config-built ~0.5B Qwen2 (random weights)
    python -m bench.memory --model demo          # the shipped demo model (the CPU default)
    python -m bench.memory --runs inprocess,oop_bucketed --steps 12

Every measurement is a short `hybridrl train` run in its own process (engines never share
state), read back from its metrics.jsonl: `time/<phase>` and, on CUDA, `mem/<phase>/*_gb` after
each phase (progress.Phases). Medians over the steps after the first `--warmup`. On CPU, vLLM has
no sleep mode and there is no device memory, so those rows print 'unmeasured (no GPU)'.
Each run is recorded in bench/results/memory.jsonl (the raw medians and the table's rows).
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
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hybridrl" / "demo_model"
UNMEASURED = "unmeasured (no GPU)"

# name -> (overrides, extra environment); the GPU-only ones need sleep mode or device memory
RUNS = {
    "inprocess": ([], {}),
    "level2": (["--rollout.sleep_level", "2"], {}),
    "no_expandable": ([], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    "oop_bucketed": (["--rollout.mode", "outofprocess", "--train.sync_bucket_mb", "256"], {}),
    "oop_per_param": (["--rollout.mode", "outofprocess", "--train.sync_bucket_mb", "0"], {}),
}
GPU_ONLY = {"level2", "no_expandable"}


def qwen2_half_b(dest: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model (494M params, bf16, random weights), built from a config: no
    download. The demo's tokenizer rides along (its ids are a subset of the vocabulary)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dest / f.name)
    return dest


def run(model: str, overrides: list[str], env: dict, steps: int) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--model",
        model,
        "--steps",
        str(steps),
        "--train.max_minutes",
        "0",
        "--log.eval_every",
        "0",
        "--log.eval_size",
        "16",
        "--log.no_progress",
        "--log.run_dir",
        str(run_dir),
        "--ckpt.every",
        "0",
        "--train.probe_action",
        "warn",
        *overrides,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return [r for r in rows if "reward" in r]


def medians(steps: list[dict], warmup: int) -> dict[str, float]:
    steps = steps[warmup:] or steps
    keys = {k for r in steps for k in r if k.startswith(("time/", "mem/"))}
    out = {k: statistics.median(r[k] for r in steps if k in r) for k in keys}
    out["step_s"] = statistics.median(sum(v for k, v in r.items() if k.startswith("time/")) for r in steps)
    return out


def table(res: dict[str, dict], cuda: bool) -> list[tuple[str, str]]:
    """(what, value) rows; GPU-only rows say so on CPU."""

    def ms(run, key):
        v = res.get(run, {}).get(key)
        return f"{v * 1000:.1f} ms" if v is not None else "not run"

    def gib(x):
        return f"{x:.2f} GiB"

    rows = []
    for level, name in ((1, "inprocess"), (2, "level2")):
        r = res.get(name, {})
        if cuda and "mem/generate/device_used_gb" in r:
            freed = r["mem/generate/device_used_gb"] - r["mem/sleep/device_used_gb"]
            rows.append((f"device memory freed by sleep level {level}", gib(freed)))
        else:
            rows.append((f"device memory freed by sleep level {level}", UNMEASURED if not cuda else "not run"))
    for tag in ("weights", "kv"):
        for level, name in ((1, "inprocess"), (2, "level2")):
            rows.append(
                (
                    f"wake latency, {tag} (after a level-{level} sleep)",
                    ms(name, f"time/wake_{tag}") if cuda else UNMEASURED,
                )
            )
    rows.append(("hand-off, in process (one pass, tensors by reference)", ms("inprocess", "time/sync")))
    rows.append(
        ("hand-off, out of process, bucketed (256 MiB staging, IPC/shared memory)", ms("oop_bucketed", "time/sync"))
    )
    rows.append(("hand-off, out of process, one handle per parameter", ms("oop_per_param", "time/sync")))
    for name, label in (
        ("inprocess", "expandable segments on (default)"),
        ("no_expandable", "expandable segments off"),
    ):
        r = res.get(name, {})
        peaks = {k.split("/")[1]: v for k, v in r.items() if k.startswith("mem/") and k.endswith("/peak_gb")}
        reserved = {k.split("/")[1]: v for k, v in r.items() if k.startswith("mem/") and k.endswith("/reserved_gb")}
        if cuda and peaks:
            for phase in sorted(peaks):
                rows.append(
                    (f"peak / reserved after {phase}, {label}", f"{peaks[phase]:.2f} / {reserved[phase]:.2f} GiB")
                )
        else:
            rows.append((f"peak memory per phase, {label}", UNMEASURED if not cuda else "not run"))
    for name in res:
        rows.append((f"step time ({name})", ms(name, "step_s")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="demo, qwen0.5b, or a model directory (default: qwen0.5b on GPU, demo on CPU)"
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    args = ap.parse_args()
    from hybridrl.core import environ

    environ.setup()
    cuda = environ.has_cuda()
    model = args.model or ("qwen0.5b" if cuda else "demo")
    if model == "qwen0.5b":
        model = str(qwen2_half_b(environ.cache_dir() / "bench-qwen2-0.5b"))
    elif model == "demo":
        model = str(DEMO)
    res = {}
    for name in args.runs.split(","):
        if name in GPU_ONLY and not cuda:
            continue  # needs sleep mode or device memory
        overrides, extra = RUNS[name]
        print(f"running {name} ...", flush=True)
        res[name] = medians(run(model, overrides, extra, args.steps), args.warmup)
    device = "cuda" if cuda else "cpu"
    print(f"\n{device}, model {Path(model).name}, medians of steps {args.warmup + 1}..{args.steps}\n")
    print("| measurement | value |\n|---|---:|")
    rows = table(res, cuda)
    for what, value in rows:
        print(f"| {what} | {value} |")
    record(
        "memory",
        {"model": Path(model).name, "steps": args.steps, "warmup": args.warmup, "runs": list(res)},
        {"medians": res, "table": [list(r) for r in rows]},
    )


if __name__ == "__main__":
    main()
