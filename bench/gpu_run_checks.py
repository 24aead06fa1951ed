"""The GPU self-check's whole-run checks: each runs `hybridrl train` as a user does (the demo, the
0.5B shape, out of process, with a critic, the planner's variants, the paths no other check takes)
and prints its rows from the run's metrics (gpu_claims.row). Run one at a time by
bench/gpu_check.py, each in its own process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_claims import CLAIMS, GIB, ROOT, half_b_model, row, verdict


def _train(args: list[str], timeout: int, env: dict | None = None) -> dict:
    """One `hybridrl train` run; its steps, summary and the tail of its output."""
    from hybridrl.core.environ import cache_dir

    (cache_dir() / "runs").mkdir(parents=True, exist_ok=True)  # not /tmp: 0.5B checkpoints are ~6 GB each
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=cache_dir() / "runs"))
    cmd = [sys.executable, "-m", "hybridrl", "train", "--log.run_dir", str(run_dir), "--log.no_progress", *args]
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    recs = [json.loads(x) for x in lines]
    steps = [r for r in recs if "reward" in r]
    summary = next((r["summary"] for r in recs if "summary" in r), {})
    plan = next((x for x in text.splitlines() if x.startswith("memory plan:")), "")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "rc": rc,
        "steps": steps,
        "summary": summary,
        "wall_s": time.perf_counter() - t,
        "plan": plan,
        "checkpoints": ckpts,
        "tail": text[-3000:],
        "cmd": " ".join(cmd),
    }


def _half_b_args(model: str) -> list[str]:
    return [
        "--model",
        model,
        "--data.path",
        "demo",
        "--reward",
        "bench.bench_rewards:text_hash",
        "--algo.no_skip_zero_advantage",
        "--train.lr",
        "1e-6",
        "--train.prompts_per_step",
        "8",
        "--rollout.n",
        "4",
        "--rollout.max_new_tokens",
        "256",
        "--rollout.max_model_len",
        "320",
        "--data.max_prompt_len",
        "48",
        "--log.eval_every",
        "0",
        "--log.eval_size",
        "16",
        "--train.max_minutes",
        "0",
        "--ckpt.every",
        "0",
        "--train.probe_action",
        "warn",
    ]


HYBRID = ("sleep", "wake_weights", "wake_kv", "offload", "reload", "sync")


def _med(steps: list[dict], key: str, skip: int = 1) -> float:
    vals = [s[key] for s in steps[skip:] or steps if key in s]
    return statistics.median(vals) if vals else float("nan")


def _phases(steps: list[dict], skip: int = 1) -> dict[str, float]:
    """Each phase's median per step; a phase that runs only on some steps (the probe, on its cadence) its
    mean over all of them, counting 0 where it did not run (a median there was NaN, or the cost of one)."""
    keys = sorted({k for s in steps for k in s if k.startswith("time/")})
    rest = steps[skip:] or steps
    return {
        k[5:]: _med(steps, k, skip) if all(k in s for s in rest) else statistics.fmean(s.get(k, 0.0) for s in rest)
        for k in keys
    }


def _failed(r: dict) -> str | None:
    if r["rc"] != 0 or not r["steps"]:
        last = [x for x in r["tail"].splitlines() if x.strip() and "Warning" not in x][-4:]
        return f"exit {r['rc']}: " + " | ".join(last)[-700:]
    return None


def check_e2e(cuda: bool) -> None:
    model = half_b_model()
    claims = [c for c, _ in CLAIMS["e2e"][1]]
    half_b = _half_b_args(model)
    gaps = {}

    # the demo, as `make demo` runs it (probe in warn mode so a gap is measured, not fatal)
    r = _train(["--train.max_minutes", "1.5", "--ckpt.every", "0", "--train.probe_action", "warn"], 200)
    err = _failed(r)
    s = r["summary"]
    if err:
        row(claims[0], err, "rises", "fail", tail=r["tail"])
    else:
        before, after = s.get("heldout_acc_before"), s.get("heldout_acc_after")
        row(
            claims[0],
            f"{before:.1%} -> {after:.1%} in {s.get('steps')} steps, {s.get('minutes', 0):.1f} min",
            "rises",
            verdict(after is not None and before is not None and after > before),
            **s,
        )
        ph = _phases(r["steps"])
        step = sum(ph.values())
        row(
            claims[1],
            f"{step * 1e3:.0f} ms/step: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])),
            "reported",
            "info",
            phases=ph,
        )
        gaps["demo fp32 max"] = max(x.get("probe_gap", 0) for x in r["steps"])
        demo_sync = ph.get("sync", float("nan"))

    # 0.5B, 20 steps, real-length completions, sleep level 2 (the default)
    r1 = _train(half_b + ["--steps", "20"], 200)
    err = _failed(r1)
    if err:
        row(claims[2], err, "reported", "fail", tail=r1["tail"])
    else:
        ph = _phases(r1["steps"], skip=2)
        step = sum(ph.values())
        over = sum(ph.get(k, 0.0) for k in HYBRID)
        row(
            claims[2],
            f"{step:.2f} s/step; rollout {_med(r1['steps'], 'rollout_tok_s', 2):.0f} tok/s, train "
            f"{_med(r1['steps'], 'train_tok_s', 2):.0f} tok/s; "
            + ", ".join(f"{k} {v / step:.1%}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])),
            "reported",
            "info",
            phases=ph,
            plan=r1["plan"],
        )
        row(
            claims[3],
            f"{over / step:.1%} (" + ", ".join(f"{k} {ph.get(k, 0) * 1e3:.0f} ms" for k in HYBRID) + ")",
            "<= 3%",
            verdict(over / step <= 0.03),
            overhead=over / step,
        )
        last = r1["steps"][-1]
        mem = {k.split("/")[1]: v for k, v in last.items() if k.startswith("mem/") and k.endswith("device_used_gb")}
        order = [
            p
            for p in ("generate", "sleep", "reload", "train", "offload", "wake_weights", "sync", "wake_kv", "probe")
            if p in mem
        ]
        row(
            claims[4],
            " -> ".join(f"{p} {mem[p]:.1f}" for p in order) + " GiB; " + r1["plan"][len("memory plan: ") :],
            "reported",
            "info",
            device_used_gb=mem,
            peaks={k: v for k, v in last.items() if k.endswith("peak_gb")},
        )
        gaps["0.5B bf16 mean"] = max(x.get("probe_gap_mean", 0) for x in r1["steps"])
        gaps["0.5B bf16 max"] = max(x.get("probe_gap", 0) for x in r1["steps"])
        n_bytes = 494032768 * 2
        row(
            claims[5],
            f"demo {demo_sync * 1e3:.1f} ms; 0.5B {ph.get('sync', 0) * 1e3:.0f} ms for "
            f"{n_bytes / GIB:.2f} GiB ({n_bytes / GIB / max(ph.get('sync', 1e-9), 1e-9):.0f} GiB/s)"
            if "demo fp32 max" in gaps
            else f"0.5B {ph.get('sync', 0) * 1e3:.0f} ms",
            "reported",
            "info",
        )
    if gaps:
        ok = gaps.get("demo fp32 max", 0) <= 1e-4 and gaps.get("0.5B bf16 mean", 0) <= 2e-2
        row(claims[6], ", ".join(f"{k} {v:.3g}" for k, v in gaps.items()), "<= 1e-4 / <= 2e-2", verdict(ok), **gaps)

    # sleep level 1 beside it: vLLM keeps its weights in host memory while asleep
    r2 = _train(half_b + ["--steps", "8", "--rollout.sleep_level", "1"], 150)
    err = _failed(r2)
    if err or _failed(r1):
        row(claims[7], err or "level-2 run failed", "reported", "fail", tail=r2["tail"])
    else:
        p2, p1 = _phases(r1["steps"], 2), _phases(r2["steps"], 2)
        o1 = sum(p1.get(k, 0) for k in HYBRID)
        o2 = sum(p2.get(k, 0) for k in HYBRID)
        row(
            claims[7],
            f"level 2 (default): {sum(p2.values()):.2f} s/step, overhead {o2 * 1e3:.0f} ms (sleep "
            f"{p2.get('sleep', 0) * 1e3:.0f}, wake {p2.get('wake_weights', 0) * 1e3:.0f}"
            f"+{p2.get('wake_kv', 0) * 1e3:.0f}"
            f" ms); level 1: {sum(p1.values()):.2f} s/step, overhead {o1 * 1e3:.0f} ms",
            "reported",
            "info",
            level1=p1,
            level2=p2,
        )

    try:
        import flash_attn  # noqa: F401

        row(
            claims[8],
            "flash-attn installed: run tests/test_packing.py on this machine",
            "packed loss == padded",
            "info",
        )
    except ImportError:
        row(
            claims[8],
            "unmeasured (flash-attn not installed: no wheel for this torch)",
            "packed loss == padded",
            "unmeasured",
        )


def check_oop(cuda: bool) -> None:
    # out of process: vLLM's engine-core process, CUDA IPC staging buckets
    results = []
    half_b = _half_b_args(half_b_model()) + ["--steps", "5", "--rollout.max_new_tokens", "32"]
    for name, args in (("demo", ["--steps", "6"]), ("0.5B", half_b)):
        r = _train(args + ["--rollout.mode", "outofprocess", "--train.probe_action", "warn"], 300)
        err = _failed(r)
        if err:
            results.append((name, err, False))
        else:
            gap = max(x.get("probe_gap", 0) for x in r["steps"])
            sync_ms = _med(r["steps"], "time/sync", 2) * 1e3
            results.append((name, f"{sync_ms:.0f} ms, probe gap {gap:.3g}", gap <= 5e-2))
    row(
        CLAIMS["oop"][1][0][0],
        "; ".join(f"{n}: {v}" for n, v, _ in results),
        "completes, probe passes",
        verdict(all(ok for *_, ok in results)),
    )


def check_critic(cuda: bool) -> None:
    # PPO with a critic: the critic's offload/reload and its checkpoint beside the policy's
    r = _train(
        [
            "--steps",
            "4",
            "--algo.advantage",
            "gae",
            "--ckpt.every",
            "2",
            "--train.probe_action",
            "warn",
            "--train.max_minutes",
            "0",
        ],
        300,
    )
    err = _failed(r)
    ckpts = r["checkpoints"]
    row(
        CLAIMS["critic"][1][0][0],
        err or f"{len(r['steps'])} steps, checkpoints {ckpts}",
        "completes",
        verdict(not err and len(r["steps"]) == 4 and bool(ckpts)),
        tail=r["tail"] if err else "",
    )


# check_variants' runs at 0.5B: name -> the arguments after the shared ones. Eager decoding is asked
# for by name: unset, rollout.enforce_eager is false on a GPU (CUDA graphs, recipe.resolve).
VARIANTS = {
    "0.5B, this plan, eager decoding (KV for the step, states kept, level 2)": ["--rollout.enforce_eager"],
    "0.5B, the previous plan, eager (KV = whole free device, states offloaded, level 1)": [
        "--rollout.enforce_eager",
        "--rollout.gpu_memory_utilization",
        "0.9",
        "--train.offload_states",
        "on",
        "--rollout.sleep_level",
        "1",
    ],
    "0.5B, this plan with CUDA graphs (the GPU default)": [],
}


def check_variants(cuda: bool) -> None:
    """Choices side by side at 0.5B: this plan vs the previous one (a KV cache of the whole free device,
    the trainer offloading, level 1), and vLLM's CUDA graphs (the GPU default) vs eager decoding,
    which left generation at 86% of the step on the H100 (2026-11-26)."""
    half_b = _half_b_args(half_b_model()) + ["--steps", "10"]
    runs = {name: half_b + extra for name, extra in VARIANTS.items()}
    out = []
    for name, args in runs.items():
        r = _train(args, 150)
        err = _failed(r)
        if err:
            out.append(f"{name}: {err}")
            continue
        ph = _phases(r["steps"], 2)
        step = sum(ph.values())
        over = sum(ph.get(k, 0) for k in HYBRID)
        s = r["summary"]
        out.append(
            f"{name}: {step * 1e3:.0f} ms/step, rollout {_med(r['steps'], 'rollout_tok_s', 2):.0f} tok/s, "
            f"overhead {over / step:.1%} ("
            + ", ".join(f"{k} {ph.get(k, 0) * 1e3:.0f}" for k in HYBRID)
            + f" ms); probe gap mean {max(x.get('probe_gap_mean', 0) for x in r['steps']):.3g}; held-out "
            f"{s.get('heldout_acc_before')} -> {s.get('heldout_acc_after')}"
        )
        row(f"variant {name}", out[-1], "reported", "info", phases=ph)


# in CLAIMS["paths"]'s order, each with its dtype's probe statistic (sync.PROBE): LoRA runs bfloat16 on
# a GPU, where vLLM's LoRA kernels take no float32
PATHS = (([], "float32"), (["--model.lora_rank", "8"], "bfloat16"), (["--train.zero_stage", "3"], "float32"))


def check_paths(cuda: bool) -> None:
    """The demo through the paths no other check takes on a GPU, each a short run with a KL term:
    the reference model's own device copy (ZeRO-2), LoRA (the adapter handed to vLLM, the base model
    as reference), ZeRO-3 (parameters partitioned at construction, gathered for the hand-off, the
    reference sharded too). With one update per rollout the policy at step 1 is the reference, so
    its KL is 0; in float32 vLLM's log-probs after each hand-off equal the trainer's to 1e-4, in
    bfloat16 (LoRA) their mean gap stays within 2e-2."""
    from hybridrl.cycle.sync import PROBE

    common = [
        "--steps",
        "4",
        "--algo.kl_coef",
        "0.05",
        "--train.minibatches",
        "1",
        "--train.probe_every",
        "1",
        "--train.probe_action",
        "warn",
        "--train.max_minutes",
        "0",
        "--log.eval_every",
        "0",
        "--ckpt.every",
        "0",
    ]
    for (claim, target), (extra, dtype) in zip(CLAIMS["paths"][1], PATHS):
        r = _train(common + extra, 200)
        err = _failed(r)
        if err:
            row(claim, err, target, "fail", tail=r["tail"])
            continue
        steps = r["steps"]
        kl1 = steps[0].get("kl_mean", float("nan"))
        stat, bound = PROBE[dtype]
        key = "probe_gap" if stat == "max" else "probe_gap_mean"
        gaps = [s[key] for s in steps if key in s]
        gap = max(gaps, default=float("nan"))
        row(
            claim,
            f"{len(steps)} steps, {dtype}; KL {kl1:.2g} at step 1, {steps[-1].get('kl_mean', float('nan')):.3g} "
            f"at step {len(steps)}; probe gap {stat} {gap:.3g} over {len(gaps)} hand-offs; hand-off "
            f"{_med(steps, 'time/sync') * 1e3:.0f} ms",
            target,
            verdict(len(steps) == 4 and abs(kl1) <= 1e-6 and len(gaps) == 4 and gap <= bound),
            kl=[s.get("kl_mean") for s in steps],
            gaps=gaps,
        )


def check_tp(cuda: bool) -> None:
    """rollout.tensor_parallel_size 2 on two GPUs: one vLLM engine over NCCL per pair of ranks, eager and
    with CUDA graphs. Unmeasured on a machine with one GPU (every machine here so far)."""
    import torch

    gpus = torch.cuda.device_count()
    common = [
        "--nproc",
        "2",
        "--rollout.tensor_parallel_size",
        "2",
        "--steps",
        "3",
        "--train.probe_every",
        "1",
        "--train.probe_action",
        "warn",
        "--train.max_minutes",
        "0",
        "--log.eval_every",
        "0",
        "--ckpt.every",
        "0",
    ]
    for (claim, target), extra in zip(CLAIMS["tp"][1], ([], ["--rollout.no_enforce_eager"])):
        if gpus < 2:
            row(claim, f"unmeasured (needs 2 GPUs, this machine has {gpus})", target, "unmeasured")
            continue
        base = _train(
            ["--nproc", "2", "--steps", "1", "--train.max_minutes", "0", "--log.eval_every", "0", "--ckpt.every", "0"],
            200,
        )  # TP 1 on the same two ranks: its greedy accuracy before training
        r = _train(common + extra, 300)
        err = _failed(r) or (f"TP 1 run: {_failed(base)}" if base["rc"] != 0 else None)
        if err:
            row(claim, err, target, "fail", tail=r["tail"])
            continue
        gaps = [s["probe_gap"] for s in r["steps"] if "probe_gap" in s]
        acc, acc1 = r["summary"].get("heldout_acc_before"), base["summary"].get("heldout_acc_before")
        row(
            claim,
            f"acc {acc} vs TP 1 {acc1}; probe gap max {max(gaps, default=float('nan')):.3g} over "
            f"{len(gaps)} hand-offs; {r['wall_s']:.0f} s for 3 steps",
            target,
            verdict(acc == acc1 and len(gaps) == 3 and max(gaps) <= 1e-4),
            gaps=gaps,
        )


if __name__ == "__main__":  # python -m bench.gpu_run_checks --help: what this module is
    print(__doc__)
