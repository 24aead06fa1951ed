"""The next GPU lease, prepared: the GPU claims, unmeasured ones first, in at most 13.5 device-minutes.

    python -m scripts.lease --plan                # the calls to make: carry, command, timeout_s, device-minutes
    python -m scripts.lease --stages prepare      # on the lent machine, call 1 (no vLLM there yet)
    python -m scripts.lease --left 200            # on the lent machine, calls 2 and 3: the stages not done
    python -m scripts.lease --out DIR             # here, without CUDA: the dry run (tests/test_lease.py)

A lent machine gives one task 15 minutes, start-up and installs included, and takes at most 64 MiB
a call: the stack comes over as scripts/gpu_bundle.sh's two parts, one per call, and the checks
follow in the time left. The stages (STAGES here; their bodies in scripts/lease_stages.py and lease_engines.py) run in a
fixed order of value, each in its own process under its own timeout (killed with its children when
it runs over). Every row goes to $OUT/lease.jsonl
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
LEASE_S = 810  # of the task's 15 device-minutes: the rest is slack for a slow start or a failed one


@dataclass(frozen=True)
class Stage:
    name: str
    timeout: int  # s: its process group is killed after
    least: int  # s: not started with fewer left in the call
    cuda: bool  # all of it needs CUDA (False: a part runs anywhere)
    what: str


# in order of value: first what issue 59's fixes need a GPU to confirm (LoRA's first hand-off on vLLM 0.26,
# sequence parallel with flash-attention, partial rollouts' memory and gain), then the claims no lease has
# measured (H100-3 measured stack to trainer_plan and the reference's device copy on 2026-11-28; docs/gpu.md),
# then those it measured, to track them
STAGES = [
    Stage(
        "prepare", 90, 30, True, "the 0.5B and 1.5B shapes' random weights and the checks' 0.5B model, into the cache"
    ),
    Stage(
        "stack", 60, 10, False, "versions, the device, and whether scripts/gpu_bundle.sh's vLLM and DeepSpeed import"
    ),
    Stage(
        "paths",
        240,
        90,
        True,
        "LoRA's first bf16 hand-off on vLLM 0.26 with the probe (issue 59: the stacked "
        "name mapper crashed it; H100-3: float32 crashed in vLLM's LoRA kernels), ZeRO-3 with zero.Init onto the "
        "device, the reference's device copy: KL 0 at step 1, the probe's gap",
    ),
    Stage(
        "sp_flash",
        120,
        60,
        True,
        "sequence parallel's attention through the wrapper, flash-attention where the "
        "bundle has it (else sdpa), 4k-16k tokens: runs (issue 59: flash raised), peak linear in the tokens",
    ),
    Stage(
        "partial_memory",
        150,
        90,
        True,
        "partial rollouts, 100 steps: vLLM holds no aborted request after any "
        "step (issue 59: their parents leaked), host RSS",
    ),
    Stage(
        "partial",
        150,
        90,
        True,
        "partial rollouts on the long-tailed demo task at its 32 prompts x 8, generation "
        "alone: rollout tokens/s on / off >= 1.3x (CPU: x1.15 there, its decode cost grows with the batch)",
    ),
    Stage(
        "demo_probe",
        120,
        90,
        True,
        "the demo in float32, 20 steps, probe every step: gap <= 1e-4 "
        "(TRITON_F32_DEFAULT=ieee; was 0.018; H100-3 cut it at 44 s, while vLLM captured its graphs)",
    ),
    Stage("critic", 150, 60, True, "PPO with a critic and checkpoints, since sleep level 2 became the default"),
    Stage(
        "asleep",
        200,
        120,
        False,
        "0.5B with CUDA graphs: what vLLM keeps on the device asleep vs the plan's graph "
        "and buffer rows (issue 47 item 5)",
    ),
    Stage(
        "decode7b",
        240,
        100,
        False,
        "vLLM alone, a 7B shape with dummy weights: 64 x 512 tokens, eager vs CUDA graphs, footprint vs the plan",
    ),
    Stage(
        "moe_decode",
        240,
        100,
        False,
        "vLLM alone, a Qwen3-30B-A3B shape with dummy weights (all 128 experts, "
        "57 GiB): 64 x 512 tokens, eager vs CUDA graphs, footprint vs the plan (every expert, top-8 activations)",
    ),
    Stage(
        "tp_rng",
        150,
        80,
        False,
        "0.5B: the group's own sampling state decides vLLM's samples whatever the global "
        "CUDA generator did (issue 47 item 6)",
    ),
    Stage(
        "cpu_adam",
        200,
        100,
        True,
        "DeepSpeed's CPU Adam over a 1.5B shape's optimizer (train.optimizer_offload) "
        "on the node's cores: torchrun's 1 thread vs the rank's share, 1 and 8 ranks",
    ),
    Stage(
        "planner",
        150,
        100,
        True,
        "vLLM's footprint vs the plan, after start and after generating (H100-3: "
        "-6.4% after start), a whole cycle at the plan",
    ),
    Stage(
        "allreduce",
        60,
        10,
        False,
        "the installed vLLM's symmetric-memory all-reduce default, and that a colocated "
        "TP engine turns it off (issue 47 item 7; H100-3: pass)",
    ),
    Stage(
        "tp_seqs",
        240,
        10,
        False,
        "max_num_seqs of a TP 2 engine as run vs as `hybridrl plan` prints it (issue 47 "
        "item 2; 2 GPUs, else the plan side)",
    ),
    Stage(
        "graphs",
        220,
        110,
        True,
        "0.5B, eager vs CUDA graphs (the GPU default now): s/step, rollout tok/s, "
        "probe after every level-2 wake (H100-3: x4.28 tok/s)",
    ),
    Stage(
        "trainer_plan",
        200,
        60,
        False,
        "trainer: planned vs measured device peak, 0.5B and 1.5B, gradient "
        "checkpointing off and on (H100-3: within 10%)",
    ),
]
BY_NAME = {s.name: s for s in STAGES}


# --- the plan of calls ---------------------------------------------------------------------------
WHEELS = ".gpu_wheels"  # scripts/gpu_bundle.sh's DIR: git-ignored, so it travels only when carried
# a cold start (H100-3: ~30 s), our turn between calls, a part's transfer (H100-3: all three calls' overheads
# together, start included, were 45 s)
START_S, GAP_S, CARRY_S, GIVE_BACK_S = 60, 20, 15, 10
ENV = (
    "set -o pipefail; export HYBRIDRL_CACHE_DIR=$PWD/.cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/{w}/site "
    "VLLM_USE_FLASHINFER_SAMPLER=0 HYBRIDRL_BENCH_RESULTS=$OUT/results; "
).format(w=WHEELS)


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

    install = (
        f"bash {WHEELS}/install.sh $PWD/{WHEELS}/site 2>&1 | tail -3 && python3 -m hybridrl.env 2>&1 | tail -2 "
        "|| echo 'install FAILED: the stages below say what is missing'; "
    )
    moe = f"tar xJf {WHEELS}/moe.tar.xz -C $PWD/{WHEELS}/site || echo 'no MoE kernels: moe_decode will fail'; "
    return [
        Call(
            (f"{WHEELS}/site.part0", f"{WHEELS}/site.sha256", f"{WHEELS}/install.sh"),
            90,
            ENV + "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; "
            "python3 -m scripts.lease --stages prepare --left 80",
            "bundle part 1 of 2 and install.sh; builds the shapes' weights (no vLLM yet)",
        ),
        Call(
            (f"{WHEELS}/site.part1", deepspeed_sdist()),
            240,
            ENV + install + checks(240),
            "bundle part 2 and DeepSpeed's source (the smaller part); install.sh (unpack, DeepSpeed), "
            "python -m hybridrl.env (fused Adam); the stages in order while time lasts",
        ),
        Call(
            (f"{WHEELS}/moe.tar.xz",),
            320,
            ENV + moe + checks(320),
            "vLLM's fused-MoE kernels (for moe_decode); the stages not done, in order, while time lasts; then "
            "give_back",
        ),
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
    print(
        f"The lease: {len(cs)} calls back to back, then give_back; at most {total} s = {total / 60:.1f} of "
        f"{LEASE_S / 60:.1f} device-minutes (the task has 15)."
    )
    print(
        f"First, here: scripts/gpu_bundle.sh {WHEELS}  (two ~55 MiB parts + install.sh + DeepSpeed's source + "
        "vLLM's MoE kernels)"
    )
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, cwd=ROOT
    ).stdout.split("\n")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())  # what travels every call
    most = 0
    for i, c in enumerate(cs, 1):
        sizes = [(ROOT / p).stat().st_size if (ROOT / p).exists() else None for p in c.carry]
        known = [s for s in sizes if s is not None]
        mib = (
            f"{sum(known) / 2**20:.1f} MiB carried + {tree / 2**20:.1f} MiB of tree"
            if known
            else "nothing carried"
            if not c.carry
            else "sizes unknown until the bundle is built"
        )
        print(f"\ncall {i}: run(timeout_s={c.timeout_s}, carry={list(c.carry)})  # {mib}; {c.does}")
        print(f"  command: {c.command}")
        if len(c.command) > 2000:
            print("  TOO LONG: the device tool takes 2000 characters")
        most = max(most, sum(known) + tree)
    print(
        "\nCall 3 may run longer where call 2's reply leaves more: timeout_s = budget_left_s - 60 (at most 600), "
        "the same number in its command's $((... - SECONDS - 15)) (H100-3 ran it at 480 s with 585 left)."
    )
    print("give_back() at once after call 3 (or after the last call you make).")
    print(
        "Then, here: append each call's results/lease.jsonl (under files_at) to bench/results/lease.jsonl, "
        "one run a line, and run python -m bench.render for the tables made from the results."
    )
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
        # committed to bench/results: paths in the checkout as the repository names them
        r = json.loads(json.dumps(r, default=str).replace(f"{ROOT}/", ""))
        with self.lock:
            self.rows.append(r)
            with open(self.out / "lease.jsonl", "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
            now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            lines = [
                f"# python -m scripts.lease on {self.device}, {now}",
                "",
                "| stage | claim | measured | target | verdict |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {x['stage']} | {x['claim']} | {x['value']} | {x.get('target', '')} | {x['verdict']} |"
                for x in self.rows
            ]
            (self.out / "lease.md").write_text("\n".join(lines) + "\n")


def run_stage(stage: Stage, seconds: float, rows: Rows, log: Path, argv: list[str] | None = None) -> str:
    """The stage in its own process group (`argv`: another command, for the tests); ROW lines
    become rows as they are printed. Returns 'done', 'failed' (its own timeout included) or 'cut'
    (killed at `seconds`, short of its timeout: the next call runs it again)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "LEASE_STAGE_S": str(int(seconds)),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        argv or [sys.executable, "-m", "scripts.lease", "--stage", stage.name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
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
        rows.add(
            stage.name,
            {
                "claim": f"{stage.name}: stage",
                "value": f"cut at {took:.0f} s ({why}); the rows above are what it measured",
                "target": f"<= {stage.timeout} s",
                "verdict": "cut",
            },
        )
        return "cut" if seconds < stage.timeout else "failed"
    if rc:
        last = " | ".join([x.strip() for x in tail if x.strip()][-3:])[-500:]
        rows.add(
            stage.name,
            {
                "claim": f"{stage.name}: stage process",
                "value": f"exit {rc}: {last}",
                "target": "exit 0",
                "verdict": "fail",
            },
        )
        return "failed"
    rows.add(
        stage.name, {"claim": f"{stage.name}: wall time", "value": f"{took:.0f} s", "target": "", "verdict": "info"}
    )
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
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout
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
            rows.add(
                stage.name,
                {
                    "claim": f"{stage.name}: {stage.what}",
                    "value": "skipped: no CUDA",
                    "target": "",
                    "verdict": "skipped",
                },
            )
            continue
        remaining = end - time.perf_counter()
        if remaining < stage.least:
            rows.add(
                stage.name,
                {
                    "claim": f"{stage.name}: {stage.what}",
                    "value": f"not started: {remaining:.0f} s left, it needs {stage.least}; the next call runs it",
                    "target": "",
                    "verdict": "later",
                },
            )
            continue
        print(f"[lease] {stage.name} ({min(stage.timeout, remaining):.0f} s at most) ...", file=sys.stderr, flush=True)
        status = run_stage(stage, min(stage.timeout, remaining), rows, log)
        if status != "cut" and cuda:  # a stage cut by the call's deadline runs again in the next call
            done.add(stage.name)
            done_file.write_text("\n".join(sorted(done)) + "\n")
    todo = [s.name for s in STAGES if s.name not in done]
    record(
        "lease",
        {"stages": names, "left_s": left, "skip_done": skip_done, "device": device},
        {"rows": rows.rows, "not_done": todo if cuda else None},
    )
    print(
        f"[lease] rows in {out}/lease.jsonl and lease.md; "
        + (f"not done: {', '.join(todo)}" if cuda and todo else "every stage done" if cuda else "dry run"),
        file=sys.stderr,
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="print the calls, their carry, timeouts and device-minutes")
    ap.add_argument(
        "--stages",
        default="",
        help=f"comma-separated, in this order: {', '.join(BY_NAME)} (default: "
        "all not done yet on this machine; named ones run again)",
    )
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
        from scripts import lease_engines, lease_stages

        if a.decode == "asleep":
            lease_engines.asleep()
        elif a.decode:
            lease_engines.decode(a.decode, a.decode_config)
        else:
            {**lease_stages.STAGE_FUNCS, **lease_engines.STAGE_FUNCS}[a.stage](environ.has_cuda())
        return 0
    names = [n for n in a.stages.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    out = Path(a.out or os.environ.get("OUT") or ROOT / ".cache" / "lease" / "out")
    return run([n for n in BY_NAME if n in names], a.left, out, skip_done=not a.stages)


if __name__ == "__main__":
    sys.exit(main())
