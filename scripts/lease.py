"""The next GPU lease, prepared: every GPU claim not yet measured, in at most 13 device-minutes.

    python -m scripts.lease --plan                # the calls to make: carry, command, timeout_s, device-minutes
    python -m scripts.lease --stages prepare      # on the lent machine, call 1 (no vLLM there yet)
    python -m scripts.lease --left 200            # on the lent machine, calls 2 and 3: the stages not done
    python -m scripts.lease --out DIR             # here, without CUDA: the dry run (tests/test_lease.py)

A lent machine gives one task 15 minutes, start-up and installs included, and takes at most 64 MiB
a call: the stack comes over as scripts/gpu_bundle.sh's two parts, one per call, and the checks
follow in the time left. The stages run in a fixed order of value, each in its own process under
its own timeout (killed with its children when it runs over). Every row goes to $OUT/lease.jsonl
and $OUT/lease.md as soon as it is measured, so a stage cut short still returns what it had; at
the call's end its rows are recorded as one run (bench/results.py: the calls set
HYBRIDRL_BENCH_RESULTS=$OUT/results, so $OUT/results/lease.jsonl comes back, to be appended to
bench/results/lease.jsonl). A
call starts no stage with fewer seconds left (--left) than the stage needs at least; the next call
goes on from the first stage not finished (listed in $HYBRIDRL_CACHE_DIR/lease/done, which stays on
the warm machine; stages named with --stages run again). Without CUDA the GPU stages record
`skipped: no CUDA`; the plan side of the trainer and 7B stages (hybridrl.cycle.plan's arithmetic) runs
anywhere.

The measurements are the GPU self-check's (bench/gpu_engine_checks.py, bench/gpu_run_checks.py,
what `make gpu-check` runs) and bench/plan_check.py's; this file orders them, sizes them to the
lease and adds the three that have no check of their own (eager vs CUDA graphs, a 7B-shape decode,
a Qwen3-30B-A3B-shape mixture-of-experts decode).

A process tool, not a benchmark, so it lives in scripts/; `python -m bench.lease ...`, the command
older notes and issues name, runs it too (bench/lease.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
GIB = 2.0 ** 30
LEASE_S = 13 * 60  # of the task's 15 device-minutes: the rest is slack for a slow start or a rerun
TRAINER_TOKENS = 8192  # train.max_tokens_per_micro_batch's default: one micro-batch of it
DECODE_SEQS, DECODE_TOKENS, DECODE_PROMPT = 64, 512, 64  # the 7B-shape and MoE decodes
# the decodes' shapes (shipped config.json, dummy weights): the whole 30B-A3B is 57 GiB of bf16 weights,
# which one H100 holds beside the decode's KV cache
DECODE_SHAPES = {"qwen2.5-7b": "7B shape", "qwen3-30b-a3b": "Qwen3-30B-A3B shape (128 experts, 8 per token)"}


@dataclass(frozen=True)
class Stage:
    name: str
    timeout: int  # s: its process group is killed after
    least: int  # s: not started with fewer left in the call
    cuda: bool  # all of it needs CUDA (False: a part runs anywhere)
    what: str


# in order of value: each stage's claim was left unverified by the last leases (docs/gpu.md)
STAGES = [
    Stage("prepare", 90, 30, True, "the 0.5B and 1.5B shapes' random weights and the checks' 0.5B model, "
          "into the cache"),
    Stage("stack", 60, 10, False, "versions, the device, and whether scripts/gpu_bundle.sh's vLLM and DeepSpeed "
          "import"),
    Stage("allreduce", 60, 10, False, "the installed vLLM's symmetric-memory all-reduce default, and that a colocated "
          "TP engine turns it off (issue 47 item 7)"),
    Stage("tp_seqs", 240, 10, False, "max_num_seqs of a TP 2 engine as run vs as `hybridrl plan` prints it (issue 47 "
          "item 2; 2 GPUs, else the plan side)"),
    Stage("planner", 150, 100, True, "vLLM's footprint vs the plan (max_num_seqs and the sampler term; was +11.8%), "
          "a whole cycle at the plan"),
    Stage("demo_probe", 100, 45, True, "the demo in float32, 20 steps, probe every step: gap <= 1e-4 "
          "(TRITON_F32_DEFAULT=ieee; was 0.018)"),
    Stage("graphs", 220, 110, True, "0.5B, eager vs CUDA graphs (the GPU default now): s/step, rollout tok/s, "
          "probe after every level-2 wake"),
    Stage("trainer_plan", 200, 60, False, "trainer: planned vs measured device peak, 0.5B and 1.5B, gradient "
          "checkpointing off and on"),
    Stage("paths", 240, 90, True, "the reference's device copy (ZeRO-2), LoRA on vLLM 0.26, ZeRO-3 with zero.Init "
          "onto the device: KL 0 at step 1, probe gap <= 1e-4"),
    Stage("critic", 150, 60, True, "PPO with a critic and checkpoints, since sleep level 2 became the default"),
    Stage("decode7b", 240, 100, False, "vLLM alone, a 7B shape with dummy weights: 64 x 512 tokens, eager vs CUDA "
          "graphs, footprint vs the plan"),
    Stage("asleep", 200, 120, False, "0.5B with CUDA graphs: what vLLM keeps on the device asleep vs the plan's graph "
          "and buffer rows (issue 47 item 5)"),
    Stage("tp_rng", 150, 80, False, "0.5B: the group's own sampling state decides vLLM's samples whatever the global "
          "CUDA generator did (issue 47 item 6)"),
    Stage("moe_decode", 240, 100, False, "vLLM alone, a Qwen3-30B-A3B shape with dummy weights (all 128 experts, "
          "57 GiB): 64 x 512 tokens, eager vs CUDA graphs, footprint vs the plan (every expert, top-8 activations)"),
    Stage("partial", 150, 90, True, "partial rollouts on the long-tailed demo task at its 32 prompts x 8, generation "
          "alone: rollout tokens/s on / off >= 1.3x (CPU: x1.15 there, its decode cost grows with the batch)"),
]
BY_NAME = {s.name: s for s in STAGES}


# --- the plan of calls ---------------------------------------------------------------------------
WHEELS = ".gpu_wheels"  # scripts/gpu_bundle.sh's DIR: git-ignored, so it travels only when carried
START_S, GAP_S, CARRY_S, GIVE_BACK_S = 90, 20, 15, 10  # a cold start, our turn between calls, a part's transfer
ENV = ("set -o pipefail; export HYBRIDRL_CACHE_DIR=$PWD/.cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/{w}/site "
       "VLLM_USE_FLASHINFER_SAMPLER=0 HYBRIDRL_BENCH_RESULTS=$OUT/results; ").format(w=WHEELS)


@dataclass(frozen=True)
class Call:
    carry: tuple[str, ...]
    timeout_s: int
    command: str
    does: str


def deepspeed_sdist() -> str:
    found = sorted((ROOT / WHEELS).glob("deepspeed-*.tar.gz"))
    if found:
        return f"{WHEELS}/{found[-1].name}"
    pin = next(x for x in (ROOT / "requirements-gpu.txt").read_text().split() if x.startswith("deepspeed=="))
    return f"{WHEELS}/deepspeed-{pin.split('==')[1]}.tar.gz"


def calls() -> list[Call]:
    """Three calls back to back (the machine goes back ~30 s after a call), then give_back. Each
    checks call's command passes lease.py the seconds its timeout leaves (bash's $SECONDS)."""
    def checks(timeout: int) -> str:  # 15 s kept back for the last rows and the transfer of $OUT
        return f"python3 -m scripts.lease --left $(({timeout} - SECONDS - 15))"
    install = (f"bash {WHEELS}/install.sh $PWD/{WHEELS}/site 2>&1 | tail -3 && python3 -m hybridrl.env 2>&1 | tail -2 "
               "|| echo 'install FAILED: the stages below say what is missing'; ")
    return [
        Call((f"{WHEELS}/site.part0", f"{WHEELS}/site.sha256", f"{WHEELS}/install.sh"), 90,
             ENV + "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; "
                   "python3 -m scripts.lease --stages prepare --left 80",
             "bundle part 1 of 2 and install.sh; builds the shapes' weights (no vLLM yet)"),
        Call((f"{WHEELS}/site.part1", deepspeed_sdist()), 240, ENV + install + checks(240),
             "bundle part 2 and DeepSpeed's source (the smaller part); install.sh (unpack, DeepSpeed), "
             "python -m hybridrl.env (fused Adam); the stages in order while time lasts"),
        Call((), 270, ENV + checks(270), "the stages not done, in order, while time lasts; then give_back"),
    ]


def budget(cs: list[Call]) -> list[tuple[str, int]]:
    """Device seconds, at most, of each step of the lease: what the 13 minutes are spent on."""
    out = [("start (a cold machine)", START_S)]
    for i, c in enumerate(cs, 1):
        out.append((f"call {i}" + (" + carry" if c.carry else ""), c.timeout_s + (CARRY_S if c.carry else 0)))
        out.append((f"our turn after call {i}", GAP_S) if i < len(cs) else ("give_back", GIVE_BACK_S))
    return out


def print_plan() -> int:
    cs = calls()
    steps = budget(cs)
    total = sum(s for _, s in steps)
    print(f"The lease: {len(cs)} calls back to back, then give_back; at most {total} s = {total / 60:.1f} of "
          f"{LEASE_S / 60:.0f} device-minutes (the task has 15).")
    print(f"First, here: scripts/gpu_bundle.sh {WHEELS}  (two ~55 MiB parts + install.sh + DeepSpeed's source)")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True,
                            text=True, cwd=ROOT).stdout.split("\n")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())  # what travels every call
    most = 0
    for i, c in enumerate(cs, 1):
        sizes = [(ROOT / p).stat().st_size if (ROOT / p).exists() else None for p in c.carry]
        known = [s for s in sizes if s is not None]
        mib = (f"{sum(known) / 2**20:.1f} MiB carried + {tree / 2**20:.1f} MiB of tree" if known else
               "nothing carried" if not c.carry else "sizes unknown until the bundle is built")
        print(f"\ncall {i}: run(timeout_s={c.timeout_s}, carry={list(c.carry)})  # {mib}; {c.does}")
        print(f"  command: {c.command}")
        if len(c.command) > 2000:
            print("  TOO LONG: the device tool takes 2000 characters")
        most = max(most, sum(known) + tree)
    print("\ngive_back() at once after call 3 (or after the last call you make).")
    print("Then, here: append each call's results/lease.jsonl (under files_at) to bench/results/lease.jsonl, "
          "one run a line, and run python -m bench.render for the tables made from the results.")
    print("\nstages, in order (timeout / least s):")
    for s in STAGES:
        print(f"  {s.name:<13} {s.timeout:>4} / {s.least:<4} {s.what}")
    print("\ndevice seconds, at most:")
    for name, s in steps:
        print(f"  {name:<28} {s:>4}")
    print(f"  {'total':<28} {total:>4}  ({'within' if total <= LEASE_S else 'OVER'} {LEASE_S} s)")
    if most > 63 * 2**20:
        print(f"WARNING: a call sends {most / 2**20:.1f} MiB with the working tree: the device tool takes 64 MiB")
    return 0 if total <= LEASE_S else 1


# --- the runner ------------------------------------------------------------------------------------
class Rows:
    """Rows as they come: appended to lease.jsonl, the whole lease.md rewritten each time."""

    def __init__(self, out: Path, device: str):
        self.out, self.device, self.rows = out, device, []
        out.mkdir(parents=True, exist_ok=True)
        (out / "lease.jsonl").write_text("")  # this run's rows only, as lease.md
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()

    def add(self, stage: str, r: dict) -> None:
        r = {"stage": stage, **r, "t_s": round(time.perf_counter() - self.t0, 1)}
        with self.lock:
            self.rows.append(r)
            with open(self.out / "lease.jsonl", "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
            now = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
            lines = [f"# python -m scripts.lease on {self.device}, {now}", "",
                     "| stage | claim | measured | target | verdict |", "|---|---|---|---|---|"]
            lines += [f"| {x['stage']} | {x['claim']} | {x['value']} | {x.get('target', '')} | {x['verdict']} |"
                      for x in self.rows]
            (self.out / "lease.md").write_text("\n".join(lines) + "\n")


def run_stage(stage: Stage, seconds: float, rows: Rows, log: Path, argv: list[str] | None = None) -> str:
    """The stage in its own process group (`argv`: another command, for the tests); ROW lines
    become rows as they are printed. Returns 'done', 'failed' (its own timeout included) or 'cut'
    (killed at `seconds`, short of its timeout: the next call runs it again)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LEASE_STAGE_S": str(int(seconds)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv or [sys.executable, "-m", "scripts.lease", "--stage", stage.name],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, start_new_session=True)
    tail: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            if line.startswith("ROW "):
                rows.add(stage.name, json.loads(line[4:]))
            else:
                tail.append(line)
                del tail[:-400]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t = time.perf_counter()
    try:
        rc = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage's runs and engines with it
        proc.wait()
        rc = None
    reader.join(10)
    took = time.perf_counter() - t
    with open(log, "a") as f:
        f.write(f"\n===== {stage.name}: exit {rc}, {took:.0f} s =====\n" + "".join(tail))
    if rc is None:
        why = "its timeout" if seconds >= stage.timeout else "the call's time left"
        rows.add(stage.name, {"claim": f"{stage.name}: stage", "value": f"cut at {took:.0f} s ({why}); the rows "
                              "above are what it measured", "target": f"<= {stage.timeout} s", "verdict": "cut"})
        return "cut" if seconds < stage.timeout else "failed"
    if rc:
        last = " | ".join([x.strip() for x in tail if x.strip()][-3:])[-500:]
        rows.add(stage.name, {"claim": f"{stage.name}: stage process", "value": f"exit {rc}: {last}",
                              "target": "exit 0", "verdict": "fail"})
        return "failed"
    rows.add(stage.name, {"claim": f"{stage.name}: wall time", "value": f"{took:.0f} s", "target": "",
                          "verdict": "info"})
    return "done"


def run(names: list[str], left: float, out: Path, skip_done: bool = True) -> int:
    from hybridrl.core import environ
    environ.setup()
    cuda = environ.has_cuda()
    done_file = environ.cache_dir() / "lease" / "done"
    done_file.parent.mkdir(parents=True, exist_ok=True)
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    device = "no CUDA (dry run)"
    if cuda:  # its name for the table's title, without initialising CUDA in this process
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True).stdout
        except OSError:
            smi = ""
        device = (smi.strip().splitlines() or ["CUDA"])[0]
    rows = Rows(out, device)
    log = out / "lease.log"
    end = time.perf_counter() + left
    for stage in (BY_NAME[n] for n in names):
        if stage.name in done and cuda and skip_done:
            continue
        if stage.cuda and not cuda:
            rows.add(stage.name, {"claim": f"{stage.name}: {stage.what}", "value": "skipped: no CUDA", "target": "",
                                  "verdict": "skipped"})
            continue
        remaining = end - time.perf_counter()
        if remaining < stage.least:
            rows.add(stage.name, {"claim": f"{stage.name}: {stage.what}", "value": f"not started: {remaining:.0f} s "
                                  f"left, it needs {stage.least}; the next call runs it", "target": "",
                                  "verdict": "later"})
            continue
        print(f"[lease] {stage.name} ({min(stage.timeout, remaining):.0f} s at most) ...", file=sys.stderr, flush=True)
        status = run_stage(stage, min(stage.timeout, remaining), rows, log)
        if status != "cut" and cuda:  # a stage cut by the call's deadline runs again in the next call
            done.add(stage.name)
            done_file.write_text("\n".join(sorted(done)) + "\n")
    todo = [s.name for s in STAGES if s.name not in done]
    record("lease", {"stages": names, "left_s": left, "skip_done": skip_done, "device": device},
           {"rows": rows.rows, "not_done": todo if cuda else None})
    print(f"[lease] rows in {out}/lease.jsonl and lease.md; " +
          (f"not done: {', '.join(todo)}" if cuda and todo else "every stage done" if cuda else "dry run"),
          file=sys.stderr)
    return 0


# --- the stages (each in its own process: `--stage NAME`; rows via gpu_claims.row) -----------------
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
        row(f"prepare: the {name} shape's random weights (bench/shapes.py)",
            f"{path} ({time.perf_counter() - t:.0f} s)")
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
    row("device", f"{p.name}, {p.total_memory / GIB:.1f} GiB, {p.multi_processor_count} SMs, "
        f"capability {p.major}.{p.minor}", verdict="info")
    row(claim, "; ".join(missing) or "all import", "all import", verdict(not missing))


def stage_planner(cuda: bool) -> None:
    from bench import gpu_engine_checks as engine
    engine.check_planner(cuda)


def stage_demo_probe(cuda: bool) -> None:
    from bench import gpu_run_checks as runs
    from bench.gpu_claims import row, verdict
    r = runs._train(["--steps", "20", "--train.probe_every", "1", "--train.probe_action", "warn",
                     "--train.max_minutes", "0", "--log.eval_every", "0", "--ckpt.every", "0"], _seconds(90))
    err = runs._failed(r)
    claim = "demo, float32, 20 steps, probe after every hand-off: largest gap (abs dlogp)"
    if err:
        row(claim, err, "<= 1e-4", "fail", tail=r["tail"])
        return
    gaps = [s["probe_gap"] for s in r["steps"] if "probe_gap" in s]
    worst = max(gaps, default=float("nan"))
    row(claim, f"{worst:.3g} over {len(gaps)} probes (the last lease, before TRITON_F32_DEFAULT=ieee: 0.018)",
        "<= 1e-4", verdict(len(gaps) >= 19 and worst <= 1e-4), gaps=gaps)
    ph = runs._phases(r["steps"])
    row("demo, float32: ms/step and phases", f"{sum(ph.values()) * 1e3:.0f} ms/step: " + ", ".join(
        f"{k} {v * 1e3:.0f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])), verdict="info", phases=ph)


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
        row(f"0.5B, {name}: s/step, rollout tok/s", f"{step:.2f} s/step, rollout {tok:.0f} tok/s, generate "
            f"{ph.get('generate', 0) / step:.0%} of the step (the last lease, eager: 4.36 s, 2,177 tok/s, 86%)",
            verdict="info", phases=ph, plan=r["plan"])
        means = [s["probe_gap_mean"] for s in r["steps"] if "probe_gap_mean" in s]
        worst = max(means, default=float("nan"))
        row(f"0.5B, {name}: probe after every level-2 wake and hand-off, bf16 mean gap", f"{worst:.3g} over "
            f"{len(means)} probes", "<= 2e-2", verdict(len(means) >= 5 and worst <= 2e-2), gaps=means)
    if len(got) == 2:
        (se, te), (sg, tg) = got["eager"], got["CUDA graphs"]
        row("0.5B: CUDA graphs vs eager (rollout.enforce_eager unset: graphs on a GPU)",
            f"rollout {tg / te:.2f}x the tokens/s, step {sg / se:.2f}x the time", "graphs faster", verdict(tg > te))


def stage_trainer_plan(cuda: bool) -> None:
    """bench/plan_check.py on the device: the plan's trainer rows (train column, bf16, ZeRO-2, one
    GPU) against torch.cuda.max_memory_allocated in the second update of one full micro-batch."""
    from bench import plan_check, shapes
    from bench.gpu_claims import row, verdict
    for name in ("0.5b", "1.5b"):
        src = str(shapes.build(name)) if cuda else f"qwen2.5-{name}"  # the same shape, shipped config.json
        for ckpt in (False, True):
            claim = (f"trainer peak, {name}, gradient checkpointing {'on' if ckpt else 'off'}, ZeRO-2, bf16, one "
                     f"{TRAINER_TOKENS}-token micro-batch: measured vs plan")
            p = plan_check.planned(src, 1, 2, ckpt, TRAINER_TOKENS, "bfloat16", on_cpu=False)
            if not cuda:
                row(claim, f"plan {p / GIB:.2f} GiB; measured: skipped: no CUDA", "within 10%", "skipped",
                    plan_gib=p / GIB)
                continue
            try:
                m = plan_check.measure(src, 1, 2, ckpt, TRAINER_TOKENS, "bfloat16", cuda=True, timeout=_seconds(120))
            except Exception as e:  # noqa: BLE001 - the row carries the worker's output
                row(claim, f"plan {p / GIB:.2f} GiB; measure failed: {str(e)[-300:]}", "within 10%", "fail")
                continue
            row(claim, f"{m / GIB:.2f} vs {p / GIB:.2f} GiB ({m / p - 1:+.1%})", "within 10%",
                verdict(abs(m / p - 1) <= 0.10), plan_gib=p / GIB, measured_gib=m / GIB)


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
        subprocess.run([sys.executable, "-m", "bench.partial_rollout", "--generate-only", "--steps", "20",
                        "--train.prompts_per_step", "32"], timeout=_seconds(140), cwd=ROOT, check=True)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        row(claim, f"failed: {e}", ">= 1.3x", "fail")
        return
    g = load("partial_rollout")[-1]["figures"]
    row(claim, f"x{g['rollout_tok_s_ratio']:.2f} ({g['off']['rollout_tok_s']:.0f} -> {g['on']['rollout_tok_s']:.0f} "
        f"tok/s; engine steps per step {g['off']['engine_steps']:.1f} -> {g['on']['engine_steps']:.1f})", ">= 1.3x",
        verdict(g["rollout_tok_s_ratio"] >= 1.3), figures={m: {k: v for k, v in g[m].items() if k != "steps"}
                                                           for m in ("off", "on")})


def decode_plan(graphs: bool, config: str = "qwen2.5-7b") -> dict[str, int]:
    """The plan's vLLM rows for a decode of `config`'s shape (bf16, one GPU, 64 sequences): its
    weights are every expert's, its activations go by the active parameters."""
    from hybridrl.core import memory
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape, read_config
    shape = Shape.from_config(read_config(config))
    weights = shape.params * 2
    kv = DECODE_SEQS * (DECODE_PROMPT + DECODE_TOKENS) * 2 * shape.layers * shape.kv_dim * 2
    kv = max(int(memory.KV_HEADROOM * kv), memory.KV_MIN)
    return {"weights": weights, "KV cache": kv,
            "activations": int(GIB + shape.active_params * 2 // 10 + memory.sampler_bytes(DECODE_SEQS, shape.vocab)),
            "CUDA graphs": plan.graph_bytes(shape, 2, DECODE_SEQS, 1) if graphs else 0,
            "buffers": plan.buffer_bytes(shape, 2, 1)}


def stage_decode7b(cuda: bool) -> None:
    from bench.gpu_claims import row
    plans = {mode: decode_plan(mode == "graphs") for mode in ("eager", "graphs")}
    for mode, p in plans.items():
        if not cuda:
            row(f"7B shape, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens", "plan " + ", ".join(
                f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: no CUDA", "", "skipped",
                plan_gib={k: v / GIB for k, v in p.items()})
            continue
        # each engine in its own process: an in-process vLLM engine does not give all its memory back
        try:
            subprocess.run([sys.executable, "-m", "scripts.lease", "--decode", mode], timeout=_seconds(110), cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            row(f"7B shape, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens", f"cut at {e.timeout:.0f} s",
                "", "fail")


def stage_moe_decode(cuda: bool) -> None:
    """decode7b's measurement for a mixture of experts: vLLM's fused-MoE kernels, every expert's
    weights in the footprint, and CUDA graphs' gain where a token reads only 8 of 128 experts."""
    from bench.gpu_claims import row
    config, label = "qwen3-30b-a3b", DECODE_SHAPES["qwen3-30b-a3b"]
    for mode in ("eager", "graphs"):
        p = decode_plan(mode == "graphs", config)
        claim = f"{label}, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens"
        if not cuda:
            row(claim, "plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: "
                "no CUDA", "", "skipped", plan_gib={k: v / GIB for k, v in p.items()})
            continue
        try:  # its own process, as decode7b's
            subprocess.run([sys.executable, "-m", "scripts.lease", "--decode", mode, "--decode-config", config],
                           timeout=_seconds(110), cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            row(claim, f"cut at {e.timeout:.0f} s", "", "fail")


def decode(mode: str, config: str = "qwen2.5-7b") -> None:
    """One engine: vLLM with a shipped shape's config (DECODE_SHAPES) and dummy weights (no download),
    64 sequences of 512 new tokens after a 64-token prompt; its footprint against the plan's rows."""
    import torch

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import row, verdict
    from hybridrl.core import environ, memory
    from hybridrl.cycle.shape import shipped_config
    from hybridrl.engines import vllm_compat
    engine._world()
    src, label = shipped_config(config), DECODE_SHAPES[config]
    model = environ.cache_dir() / f"lease-{config}-config"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(src.read_text())
    from vllm import LLM, SamplingParams
    p = decode_plan(mode == "graphs", config)
    kw = vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=p["KV cache"], gpu_memory_utilization=0.9,
                                   sleep_mode=False, max_num_seqs=DECODE_SEQS, enforce_eager=mode == "eager")
    before = engine._used()
    t = time.perf_counter()
    with memory.vllm_pool(True), vllm_compat.engine_env(out_of_process=False, local_rank=0, cuda=True):  # as Rollout
        llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  enforce_eager=mode == "eager", max_model_len=DECODE_PROMPT + DECODE_TOKENS + 64, **kw)
    start_s = time.perf_counter() - t
    footprint = engine._used() - before
    planned = sum(p.values())
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 150000, (DECODE_PROMPT,), generator=g).tolist()}
               for _ in range(DECODE_SEQS)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=1.0, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    times = []
    for _ in range(2):
        times.append(engine._timed(lambda: llm.generate(prompts, params, use_tqdm=False)))
    best = min(times)
    row(f"{label}, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens",
        f"{DECODE_SEQS * DECODE_TOKENS / best:.0f} tok/s ({best:.2f} s, best of {len(times)}); engine start "
        f"{start_s:.0f} s", "reported", "info", times=times, start_s=start_s)
    err = footprint / planned - 1
    row(f"{label}, {mode}: vLLM's footprint vs the plan", f"{footprint / GIB:.2f} vs {planned / GIB:.2f} GiB "
        f"({err:+.1%}; plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + ")", "within 5%",
        verdict(abs(err) <= 0.05), footprint_gib=footprint / GIB, plan_gib={k: v / GIB for k, v in p.items()})


# --- issue 47's GPU-only checks (items 2, 5, 6, 7): the decision runs anywhere, the effect needs CUDA ---
def stage_allreduce(cuda: bool) -> None:
    """vLLM picks its symmetric-memory all-reduce from VLLM_ALLREDUCE_USE_SYMM_MEM alone; the
    installed vLLM's default (0.32 on CPU, 0.26 on the lease's GPU) and what a TP engine sets."""
    from bench.gpu_claims import row, verdict
    from hybridrl.engines import vllm_compat
    default = vllm_compat.env_default(vllm_compat.SYMM_MEM)
    env = vllm_compat.all_reduce_env({}, tensor_parallel_size=2, on_cpu=False)
    row(f"vLLM {vllm_compat.VERSION}: {vllm_compat.SYMM_MEM} default, and a colocated TP 2 engine's setting",
        f"default {default}; set {env or 'nothing'}", "off for TP engines", verdict(not default or env.get(
            vllm_compat.SYMM_MEM) == "0"), default=default, env=env)


def _plan_seqs(args: list[str]) -> int | None:
    """rollout.max_num_seqs as `hybridrl plan ARGS` prints it."""
    import re
    out = subprocess.run([sys.executable, "-m", "hybridrl", "plan", *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT).stdout
    found = re.search(r"rollout\.max_num_seqs=(\d+) per engine", out)
    return int(found.group(1)) if found else None


def stage_tp_seqs(cuda: bool) -> None:
    """A TP engine serves its group's requests: max_num_seqs as planned (the 72B recipe, anywhere) and,
    on 2 GPUs, as a TP 2 demo run's engine gets it against `hybridrl plan` with the same arguments."""
    import re

    from bench.gpu_claims import row, verdict
    planned = _plan_seqs(["--config", "examples/recipes/qwen2.5-72b-8xh100.yaml", "--nproc", "8"])
    row("72B recipe, 8 GPUs, TP 4: max_num_seqs per engine as planned", f"{planned} (the step's 4 x 32 and the "
        "held-out 4 x 64 sequences of the group; one rank's share was 64)", "256", verdict(planned == 256))
    claim = "TP 2 on 2 GPUs, the demo: max_num_seqs the engine gets vs `hybridrl plan`"
    gpus = 0
    if cuda:
        import torch
        gpus = torch.cuda.device_count()
    if gpus < 2:
        row(claim, f"unmeasured (needs 2 GPUs, this machine has {gpus})" if cuda else "skipped: no CUDA", "equal",
            "unmeasured" if cuda else "skipped")
        return
    from bench import gpu_run_checks as runs
    args = ["--nproc", "2", "--rollout.tensor_parallel_size", "2"]
    r = runs._train(args + ["--steps", "1", "--train.max_minutes", "0", "--log.eval_every", "0", "--ckpt.every", "0"],
                    _seconds(200))
    err = runs._failed(r)
    ran = re.search(r"rollout\.max_num_seqs=(\d+)", r["plan"])
    printed = _plan_seqs(args)
    if err or not ran:
        row(claim, err or f"no max_num_seqs in the run's plan line: {r['plan']!r}", "equal", "fail", tail=r["tail"])
        return
    row(claim, f"{ran.group(1)} run vs {printed} planned; the group's ranks sampled in step (the run finished)",
        "equal", verdict(int(ran.group(1)) == printed))


def stage_asleep(cuda: bool) -> None:
    """The plan's rows for what vLLM keeps asleep (0.5B, bf16, TP 1, 64 sequences, CUDA graphs) and, on a
    GPU, the device memory vLLM still holds after a level-2 sleep, in its own process."""
    from bench.gpu_claims import row
    if not cuda:
        from hybridrl.cycle import plan
        from hybridrl.cycle.shape import Shape, read_config
        shape = Shape.from_config(read_config("qwen2.5-0.5b"))
        p = {"CUDA graphs": plan.graph_bytes(shape, 2, DECODE_SEQS, 1), "buffers": plan.buffer_bytes(shape, 2, 1)}
        row("0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan", "plan " + ", ".join(
            f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: no CUDA", "", "skipped",
            plan_gib={k: v / GIB for k, v in p.items()})
        return
    try:
        subprocess.run([sys.executable, "-m", "scripts.lease", "--decode", "asleep"], timeout=_seconds(180), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        row("0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan", f"cut at {e.timeout:.0f} s",
            "", "fail")


def _half_b_engine(enforce_eager: bool, sleep_mode: bool):
    from vllm import LLM

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import half_b_model
    from hybridrl.core import memory
    from hybridrl.engines import vllm_compat
    engine._world()
    kw = vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=GIB, gpu_memory_utilization=0.3,
                                   sleep_mode=sleep_mode, max_num_seqs=DECODE_SEQS, enforce_eager=enforce_eager)
    with memory.vllm_pool(True), vllm_compat.engine_env(out_of_process=False, local_rank=0, cuda=True):
        return LLM(model=half_b_model(), dtype="bfloat16", seed=0, enforce_eager=enforce_eager, max_model_len=1024,
                   **kw)


def asleep() -> None:
    """One 0.5B engine with CUDA graphs and sleep mode: what it holds after a level-2 sleep."""
    import torch
    from vllm import SamplingParams

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import row, verdict
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape, read_config
    torch.cuda.init()
    before = engine._used()
    llm = _half_b_engine(enforce_eager=False, sleep_mode=True)
    awake = engine._used() - before
    llm.generate([{"prompt_token_ids": list(range(100, 164))}] * 8, SamplingParams(max_tokens=32, ignore_eos=True),
                 use_tqdm=False)
    from hybridrl.core import memory
    with memory.vllm_pool(True):  # as Rollout.sleep
        llm.sleep(level=2)
    kept = engine._used() - before
    shape = Shape.from_config(read_config("qwen2.5-0.5b"))
    graphs, buffers = plan.graph_bytes(shape, 2, DECODE_SEQS, 1), plan.buffer_bytes(shape, 2, 1)
    planned = graphs + buffers
    row("0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan",
        f"{kept / GIB:.2f} GiB kept of {awake / GIB:.2f} awake vs plan {planned / GIB:.2f} (graphs "
        f"{graphs / GIB:.2f}, buffers {buffers / GIB:.2f}; the CUDA context is the reserve's)", "plan >= measured",
        verdict(kept <= planned), kept_gib=kept / GIB, awake_gib=awake / GIB, plan_gib=planned / GIB)


def stage_tp_rng(cuda: bool) -> None:
    """The group's sampling state (vllm_compat.SamplingRNG): on CPU that it is isolated from the global
    generator; on a GPU that it, not the global CUDA generator, decides vLLM's unseeded samples."""
    import torch

    from bench.gpu_claims import row, verdict
    from hybridrl.engines import vllm_compat
    rng = vllm_compat.SamplingRNG(7, cuda=False)
    with rng.active():
        a = torch.rand(4)
    torch.rand(10)  # a rank-local random op
    again = vllm_compat.SamplingRNG(7, cuda=False)
    with again.active():
        b = torch.rand(4)
    row("SamplingRNG on CPU: a rank-local random op outside does not change the draws inside",
        "identical" if torch.equal(a, b) else "DIFFER", "identical", verdict(torch.equal(a, b)))
    claim = "0.5B on a GPU: unseeded samples under the group's state, a rank-local CUDA random op between"
    if not cuda:
        row(claim, "skipped: no CUDA", "identical", "skipped")
        return
    from vllm import SamplingParams
    llm = _half_b_engine(enforce_eager=True, sleep_mode=False)
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, detokenize=False)

    def sample(state: bool) -> list:
        if state:
            with vllm_compat.SamplingRNG(11, cuda=True).active():
                outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            torch.cuda.manual_seed(11)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    first = sample(True)
    torch.rand(1000, device="cuda")  # a rank-local random op on the global CUDA generator
    second = sample(True)
    g1 = sample(False)
    torch.rand(1000, device="cuda")
    g2 = sample(False)
    torch.cuda.manual_seed(11)
    torch.rand(1000, device="cuda")
    g3 = llm.generate(prompts, params, use_tqdm=False)
    moved = [list(o.outputs[0].token_ids) for o in g3] != g1
    row(claim, f"{'identical' if first == second else 'DIFFER'}; the global generator alone: same seed "
        f"{'identical' if g1 == g2 else 'differs'}, moved by the op {'differs' if moved else 'identical'}",
        "identical (and the moved global generator differs)", verdict(first == second and moved))


STAGE_FUNCS = {"prepare": stage_prepare, "stack": stage_stack, "allreduce": stage_allreduce, "tp_seqs": stage_tp_seqs,
               "planner": stage_planner, "demo_probe": stage_demo_probe, "graphs": stage_graphs,
               "trainer_plan": stage_trainer_plan, "paths": stage_paths, "critic": stage_critic,
               "decode7b": stage_decode7b, "asleep": stage_asleep, "tp_rng": stage_tp_rng,
               "moe_decode": stage_moe_decode, "partial": stage_partial}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="print the calls, their carry, timeouts and device-minutes")
    ap.add_argument("--stages", default="", help=f"comma-separated, in this order: {', '.join(BY_NAME)} (default: "
                    "all not done yet on this machine; named ones run again)")
    ap.add_argument("--left", type=float, default=LEASE_S, help="seconds this call has left for the stages")
    ap.add_argument("--out", default=None, help="where the rows go (default $OUT, else .cache/lease/out)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--decode", help=argparse.SUPPRESS)
    ap.add_argument("--decode-config", default="qwen2.5-7b", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plan:
        return print_plan()
    if a.stage or a.decode:
        from hybridrl.core import environ
        environ.setup()
        if a.decode == "asleep":
            asleep()
        elif a.decode:
            decode(a.decode, a.decode_config)
        else:
            STAGE_FUNCS[a.stage](environ.has_cuda())
        return 0
    names = [n for n in a.stages.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    out = Path(a.out or os.environ.get("OUT") or ROOT / ".cache" / "lease" / "out")
    return run([n for n in BY_NAME if n in names], a.left, out, skip_done=not a.stages)


if __name__ == "__main__":
    sys.exit(main())
