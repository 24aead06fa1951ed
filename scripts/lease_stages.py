"""The lease's stages (scripts/lease.py): each runs in its own process (`python -m scripts.lease
--stage NAME`), under the timeout its Stage gives it, and reports rows with bench.gpu_claims.row.
Without CUDA a stage measures what runs anywhere (the plan's side) and marks the rest skipped.
The stages that start a vLLM engine alone, without a trainer, are scripts/lease_engines.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2.0**30
TRAINER_TOKENS = 8192  # train.max_tokens_per_micro_batch's default: one micro-batch of it
_STAGE_END = time.perf_counter() + float(os.environ.get("LEASE_STAGE_S", 1e9))  # the runner kills the stage then


def _seconds(default: float, margin: float = 10) -> float:
    """A run's timeout inside the stage: what the stage has left, less a margin for its rows, at most
    `default`."""
    return max(10.0, min(default, _STAGE_END - time.perf_counter() - margin))


def stage_prepare(cuda: bool) -> None:
    from bench import shapes
    from bench.gpu_claims import half_b_model, row

    for name in ("0.5b", "1.5b"):
        t = time.perf_counter()
        path = shapes.build(name)
        row(
            f"prepare: the {name} shape's random weights (bench/shapes.py)", f"{path} ({time.perf_counter() - t:.0f} s)"
        )
    t = time.perf_counter()
    model = half_b_model()
    row("prepare: the checks' 0.5B model (gpu_claims.half_b_model)", f"{model} ({time.perf_counter() - t:.0f} s)")


def stage_stack(cuda: bool) -> None:
    import importlib

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import row, verdict

    engine.check_stack(cuda)
    claim = "scripts/gpu_bundle.sh's stack imports (vLLM, DeepSpeed, Liger)"
    if not cuda:  # the CPU stack's imports are the test suite's to check
        row(claim, "skipped: no CUDA", "all import", "skipped")
        return
    missing = []
    for name in ("vllm", "deepspeed", "liger_kernel"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the row says what failed
            missing.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    import torch

    p = torch.cuda.get_device_properties(0)
    row(
        "device",
        f"{p.name}, {p.total_memory / GIB:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}",
        verdict="info",
    )
    row(claim, "; ".join(missing) or "all import", "all import", verdict(not missing))


def stage_planner(cuda: bool) -> None:
    from bench import gpu_engine_checks as engine

    engine.check_planner(cuda)


def stage_demo_probe(cuda: bool) -> None:
    from bench import gpu_run_checks as runs
    from bench.gpu_claims import row, verdict

    r = runs._train(
        [
            "--steps",
            "20",
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
        ],
        _seconds(90),
    )
    err = runs._failed(r)
    claim = "demo, float32, 20 steps, probe after every hand-off: largest gap (abs dlogp)"
    if err:
        row(claim, err, "<= 1e-4", "fail", tail=r["tail"])
        return
    gaps = [s["probe_gap"] for s in r["steps"] if "probe_gap" in s]
    worst = max(gaps, default=float("nan"))
    row(
        claim,
        f"{worst:.3g} over {len(gaps)} probes (the last lease, before TRITON_F32_DEFAULT=ieee: 0.018)",
        "<= 1e-4",
        verdict(len(gaps) >= 19 and worst <= 1e-4),
        gaps=gaps,
    )
    ph = runs._phases(r["steps"])
    row(
        "demo, float32: ms/step and phases",
        f"{sum(ph.values()) * 1e3:.0f} ms/step: "
        + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])),
        verdict="info",
        phases=ph,
    )


def stage_graphs(cuda: bool) -> None:
    """0.5B, the last leases' workload (8 prompts x 4 x 256 tokens), 6 steps each way, the probe
    after every hand-off: the level-2 wake rebuilds the weights under the captured graphs."""
    from bench import gpu_run_checks as runs
    from bench.gpu_claims import half_b_model, row, verdict

    args = runs._half_b_args(half_b_model()) + ["--steps", "6", "--train.probe_every", "1"]
    got = {}
    for name, flag in (("eager", "--rollout.enforce_eager"), ("CUDA graphs", "--rollout.no_enforce_eager")):
        r = runs._train(args + [flag], _seconds(100) if name == "eager" else _seconds(120))
        err = runs._failed(r)
        if err:
            row(f"0.5B, {name}: s/step, rollout tok/s", err, "", "fail", tail=r["tail"])
            continue
        ph = runs._phases(r["steps"], 2)
        step, tok = sum(ph.values()), runs._med(r["steps"], "rollout_tok_s", 2)
        got[name] = (step, tok)
        row(
            f"0.5B, {name}: s/step, rollout tok/s",
            f"{step:.2f} s/step, rollout {tok:.0f} tok/s, generate "
            f"{ph.get('generate', 0) / step:.0%} of the step (the last lease, eager: 4.36 s, 2,177 tok/s, 86%)",
            verdict="info",
            phases=ph,
            plan=r["plan"],
        )
        means = [s["probe_gap_mean"] for s in r["steps"] if "probe_gap_mean" in s]
        worst = max(means, default=float("nan"))
        row(
            f"0.5B, {name}: probe after every level-2 wake and hand-off, bf16 mean gap",
            f"{worst:.3g} over {len(means)} probes",
            "<= 2e-2",
            verdict(len(means) >= 5 and worst <= 2e-2),
            gaps=means,
        )
    if len(got) == 2:
        (se, te), (sg, tg) = got["eager"], got["CUDA graphs"]
        row(
            "0.5B: CUDA graphs vs eager (rollout.enforce_eager unset: graphs on a GPU)",
            f"rollout {tg / te:.2f}x the tokens/s, step {sg / se:.2f}x the time",
            "graphs faster",
            verdict(tg > te),
        )


def stage_trainer_plan(cuda: bool) -> None:
    """bench/plan_check.py on the device: the plan's trainer rows (train column, bf16, ZeRO-2, one
    GPU) against torch.cuda.max_memory_allocated in the second update of one full micro-batch."""
    from bench import plan_check, shapes
    from bench.gpu_claims import row, verdict

    for name in ("0.5b", "1.5b"):
        src = str(shapes.build(name)) if cuda else f"qwen2.5-{name}"  # the same shape, shipped config.json
        for ckpt in (False, True):
            claim = (
                f"trainer peak, {name}, gradient checkpointing {'on' if ckpt else 'off'}, ZeRO-2, bf16, one "
                f"{TRAINER_TOKENS}-token micro-batch: measured vs plan"
            )
            p = plan_check.planned(src, 1, 2, ckpt, TRAINER_TOKENS, "bfloat16", on_cpu=False)
            if not cuda:
                row(
                    claim,
                    f"plan {p / GIB:.2f} GiB; measured: skipped: no CUDA",
                    "within 10%",
                    "skipped",
                    plan_gib=p / GIB,
                )
                continue
            try:
                m = plan_check.measure(src, 1, 2, ckpt, TRAINER_TOKENS, "bfloat16", cuda=True, timeout=_seconds(120))
            except Exception as e:  # noqa: BLE001 - the row carries the worker's output
                row(claim, f"plan {p / GIB:.2f} GiB; measure failed: {str(e)[-300:]}", "within 10%", "fail")
                continue
            row(
                claim,
                f"{m / GIB:.2f} vs {p / GIB:.2f} GiB ({m / p - 1:+.1%})",
                "within 10%",
                verdict(abs(m / p - 1) <= 0.10),
                plan_gib=p / GIB,
                measured_gib=m / GIB,
            )


def stage_paths(cuda: bool) -> None:
    from bench import gpu_run_checks as runs

    runs.check_paths(cuda)


def stage_critic(cuda: bool) -> None:
    from bench import gpu_run_checks as runs

    runs.check_critic(cuda)


def stage_partial(cuda: bool) -> None:
    """bench/partial_rollout.py --generate-only on the device: both modes alternated on one engine, the
    policy fixed. A GPU's decode iteration costs about the same at any batch, where partial rollouts'
    fewer iterations should show as throughput (docs/partial.md); `rollout.partial` stays off by default
    until this passes."""
    from bench.gpu_claims import row, verdict
    from bench.results import load

    claim = "partial rollouts, long-tailed demo task, 32 prompts x 8, generation alone: rollout tokens/s on / off"
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.partial_rollout",
                "--generate-only",
                "--steps",
                "20",
                "--train.prompts_per_step",
                "32",
            ],
            timeout=_seconds(140),
            cwd=ROOT,
            check=True,
        )
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        row(claim, f"failed: {e}", ">= 1.3x", "fail")
        return
    g = load("partial_rollout")[-1]["figures"]
    row(
        claim,
        f"x{g['rollout_tok_s_ratio']:.2f} ({g['off']['rollout_tok_s']:.0f} -> {g['on']['rollout_tok_s']:.0f} "
        f"tok/s; engine steps per step {g['off']['engine_steps']:.1f} -> {g['on']['engine_steps']:.1f})",
        ">= 1.3x",
        verdict(g["rollout_tok_s_ratio"] >= 1.3),
        figures={m: {k: v for k, v in g[m].items() if k != "steps"} for m in ("off", "on")},
    )


def stage_sp_flash(cuda: bool) -> None:
    """bench/sp_attention.py on the device: one attention layer through the sequence-parallel wrapper
    with flash-attention where the bundle has it (else sdpa), rows of 4k-16k tokens. Before issue 59's
    fix the flash path raised at its first forward and the sdpa path built an [L, L] mask per layer:
    it must run, and its peak grow with the tokens, not their square."""
    from bench.gpu_claims import row, verdict
    from bench.results import load

    claim = "sequence parallel's attention (flash where installed), one layer, 4k-16k tokens: peak MiB per 1k tokens"
    try:
        subprocess.run(
            [sys.executable, "-m", "bench.sp_attention", "--cuda"], timeout=_seconds(110), cwd=ROOT, check=True
        )
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        row(claim, f"failed: {e}", "runs; 16k within 1.5x of 4k per token", "fail")
        return
    r = load("sp_attention")[-1]
    per = {x["tokens"]: x["wrapper_mib"] / x["tokens"] * 1024 for x in r["figures"]["rows"]}
    row(
        claim,
        f"{r['workload']['impl']}: " + ", ".join(f"{k // 1024}k {v:.1f}" for k, v in per.items()),
        "runs; 16k within 1.5x of 4k per token",
        verdict(per[16384] <= 1.5 * per[4096]),
        figures=r["figures"],
    )


def stage_partial_memory(cuda: bool) -> None:
    """bench/partial_memory.py on the device: 100 steps of partial rollouts on the long-tailed task at its
    32 prompts x 8; vLLM must hold no request after any step's abort (issue 59: aborted groups' parents
    stayed, ~3 MB per 8k-token sample with a MoE model's routed experts attached)."""
    from bench.gpu_claims import row, verdict
    from bench.results import load

    claim = "partial rollouts, 100 steps: requests vLLM holds after each abort; host RSS from step 10"
    try:
        subprocess.run(
            [sys.executable, "-m", "bench.partial_memory", "--steps", "100", "--train.prompts_per_step", "32"],
            timeout=_seconds(140),
            cwd=ROOT,
            check=True,
        )
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        row(claim, f"failed: {e}", "0 held", "fail")
        return
    f = load("partial_memory")[-1]["figures"]
    held = max(int(x["held"] or 0) for x in f["table"])
    row(
        claim,
        f"held at most {held}; RSS {f['rss_growth_mib']:+.0f} MiB over {f['aborted_samples']:.0f} aborted samples",
        "0 held",
        verdict(held == 0),
        figures=f,
    )


def stage_cpu_adam(cuda: bool) -> None:
    """bench/cpu_adam_threads.py on the lent machine's cores: DeepSpeed's CPU Adam over a 1.5B shape's
    optimizer, which train.optimizer_offload steps on the host, with torchrun's one thread vs the
    rank's share of the cores (zero_engine.host_step_threads). One GPU holds the whole optimizer; on
    an 8-GPU node each rank steps an eighth. DS_ACCELERATOR=cuda: the op call 2 built, as a run uses."""
    from bench.gpu_claims import row, verdict
    from bench.results import load
    from hybridrl.cycle.shape import Shape, read_config

    params = Shape.from_config(read_config("qwen2.5-1.5b")).params
    for ranks in (1, 8):
        claim = (
            f"CPU Adam step, 1.5B shape ({params / 1e9:.2f}B fp32 parameters) over {ranks} rank(s): 1 thread "
            "vs the rank's share of the cores"
        )
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.cpu_adam_threads",
                    "--ranks",
                    str(ranks),
                    "--params",
                    str(params // ranks),
                    "--steps",
                    "3",
                ],
                timeout=_seconds(100),
                cwd=ROOT,
                check=True,
                env={**os.environ, "DS_ACCELERATOR": "cuda"},
            )
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
            row(claim, f"failed: {e}", "the share faster", "fail")
            continue
        g = load("cpu_adam_threads")[-1]["figures"]
        share, t = str(g["share"]), g["step_s"]
        row(
            claim,
            f"{t['1']:.2f} s with 1 thread, {t[share]:.2f} s with {share} (x{t['1'] / t[share]:.2f})",
            "the share faster",
            verdict(t[share] < t["1"]) if share != "1" else "info",
            figures=g,
        )


# --- issue 47's GPU-only checks (items 2, 5, 6, 7): the decision runs anywhere, the effect needs CUDA ---
def stage_allreduce(cuda: bool) -> None:
    """vLLM picks each of its IPC all-reduces (symmetric memory, FlashInfer's) from one variable; the
    installed vLLM's defaults (0.32 on CPU, 0.26 on the lease's GPU) and what a TP engine sets."""
    from bench.gpu_claims import row, verdict
    from hybridrl.engines import vllm_compat

    defaults = {name: vllm_compat.env_default(name) for name in vllm_compat.IPC_ALL_REDUCES}
    env = vllm_compat.all_reduce_env({}, tensor_parallel_size=2, on_cpu=False)
    row(
        f"vLLM {vllm_compat.VERSION}: the IPC all-reduce switches' defaults, and a colocated TP 2 engine's setting",
        f"defaults {defaults}; set {env or 'nothing'}",
        "off for TP engines",
        verdict(all(not on or env.get(name) == "0" for name, on in defaults.items())),
        default=defaults,
        env=env,
    )


def _plan_seqs(args: list[str]) -> int | None:
    """rollout.max_num_seqs as `hybridrl plan ARGS` prints it."""
    import re

    out = subprocess.run(
        [sys.executable, "-m", "hybridrl", "plan", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    ).stdout
    found = re.search(r"rollout\.max_num_seqs=(\d+) per engine", out)
    return int(found.group(1)) if found else None


def stage_tp_seqs(cuda: bool) -> None:
    """A TP engine serves its group's requests: max_num_seqs as planned (the 72B recipe, anywhere) and,
    on 2 GPUs, as a TP 2 demo run's engine gets it against `hybridrl plan` with the same arguments."""
    import re

    from bench.gpu_claims import row, verdict

    planned = _plan_seqs(["--config", "examples/recipes/qwen2.5-72b-8xh100.yaml", "--nproc", "8"])
    row(
        "72B recipe, 8 GPUs, TP 4: max_num_seqs per engine as planned",
        f"{planned} (the step's 4 x 32 and the held-out 4 x 64 sequences of the group; one rank's share was 64)",
        "256",
        verdict(planned == 256),
    )
    claim = "TP 2 on 2 GPUs, the demo: max_num_seqs the engine gets vs `hybridrl plan`"
    gpus = 0
    if cuda:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < 2:
        row(
            claim,
            f"unmeasured (needs 2 GPUs, this machine has {gpus})" if cuda else "skipped: no CUDA",
            "equal",
            "unmeasured" if cuda else "skipped",
        )
        return
    from bench import gpu_run_checks as runs

    args = ["--nproc", "2", "--rollout.tensor_parallel_size", "2"]
    r = runs._train(
        args + ["--steps", "1", "--train.max_minutes", "0", "--log.eval_every", "0", "--ckpt.every", "0"], _seconds(200)
    )
    err = runs._failed(r)
    ran = re.search(r"rollout\.max_num_seqs=(\d+)", r["plan"])
    printed = _plan_seqs(args)
    if err or not ran:
        row(claim, err or f"no max_num_seqs in the run's plan line: {r['plan']!r}", "equal", "fail", tail=r["tail"])
        return
    row(
        claim,
        f"{ran.group(1)} run vs {printed} planned; the group's ranks sampled in step (the run finished)",
        "equal",
        verdict(int(ran.group(1)) == printed),
    )


STAGE_FUNCS = {
    "prepare": stage_prepare,
    "stack": stage_stack,
    "allreduce": stage_allreduce,
    "tp_seqs": stage_tp_seqs,
    "planner": stage_planner,
    "demo_probe": stage_demo_probe,
    "graphs": stage_graphs,
    "trainer_plan": stage_trainer_plan,
    "paths": stage_paths,
    "critic": stage_critic,
    "partial": stage_partial,
    "cpu_adam": stage_cpu_adam,
    "sp_flash": stage_sp_flash,
    "partial_memory": stage_partial_memory,
}
