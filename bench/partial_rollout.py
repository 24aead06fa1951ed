"""Partial rollouts against the synchronous step on the long-tailed task, side by side in one run.

For each seed, `hybridrl train --data.path longtail` (tasks/longtail.py: answers of 2 to 48 tokens,
the demo model warmed on them) runs once with `--rollout.partial off` and once with `on`, one after
the other, same seeds, same steps; printed, one table: the median step time, rollout tokens/s (the
tokens vLLM generated over the generate phase's time, the first step's engine warm-up left out),
the held-out accuracy curve against the engine clock (train.max_minutes' clock: it counts the
evaluations, the same for both) and the time to an accuracy, then the ratio of the two rows. On a
machine shared with other jobs timings wobble: compare the two rows of one run, not runs.

    python -m bench.partial_rollout                       # 1 seed, 120 steps each, eval every 20
    python -m bench.partial_rollout --seeds 0 1 --steps 200 --target 0.55 --log.eval_size 128   # flags go to both runs
    python -m bench.partial_rollout --generate-only --steps 20  # rollout throughput alone, alternated in one process

The shape is 16 prompts x 8 samples in one update per rollout unless flags say otherwise (SHAPE):
on this CPU a decode iteration of the demo model costs ~2.5 ms plus ~0.23 ms per running sequence,
so at the demo's 32 prompts (256 sequences) the work follows the tokens and partial rollouts save
little; at 16 a decode iteration costs nearly the same at any batch, as a GPU's does up to hundreds
of sequences (docs/partial.md). One update per rollout: its own forward is pi_old for the importance
correction, as in the 7B-72B recipes.

One row per run in bench/results/partial_rollout.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"--train.prompts_per_step": "16", "--train.minibatches": "1"}  # flags given win


def run(mode: str, seed: int, steps: int, eval_every: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{mode}-seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--data.path",
        "longtail",
        "--rollout.partial",
        mode,
        "--steps",
        str(steps),
        "--train.seed",
        str(seed),
        "--log.eval_every",
        str(eval_every),
        "--train.max_minutes",
        "0",
        "--log.run_dir",
        str(run_dir),
        *extra,
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    conf = yaml.safe_load((run_dir / "config.yaml").read_text())
    steps_ = [r for r in rows if "reward" in r]
    at = {r["step"]: r["elapsed_s"] for r in steps_}
    curve = [(r["step"], at.get(r["step"], 0.0), r["heldout_acc"]) for r in rows if "heldout_acc" in r]
    warm = steps_[1:]  # the first step pays vLLM's and the trainer's first calls
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps_, steps_[1:])]
    gen = sum(r["time/generate"] for r in warm)
    # trained samples per second of the whole step: a partial step trains its share or a few more groups
    groups = [r.get("partial/trained_groups", conf["train"]["prompts_per_step"]) for r in warm]
    samples_s = conf["rollout"]["n"] * statistics.mean(groups) / statistics.median(walls)
    return {
        "mode": mode,
        "seed": seed,
        "wall_s": time.perf_counter() - t0,
        "step_s": statistics.median(walls),
        "generate_s": statistics.median(r["time/generate"] for r in warm),
        "rollout_tok_s": sum(r["rollout_tokens"] for r in warm) / gen,
        "samples_s": samples_s,
        "response_len": statistics.mean(r["response_len"] for r in warm),
        "truncated_frac": statistics.mean(r["truncated_frac"] for r in warm),
        "stale_token_frac": statistics.mean(r.get("partial/stale_token_frac", 0.0) for r in warm),
        "curve": curve,
        "reward_last20": statistics.mean(r["reward"] for r in steps_[-20:]),
    }


def generate_only(steps: int, seed: int, extra: list[str]) -> dict:
    """Rollout throughput alone, in one process on one engine: a synchronous step's generation and
    a partial step's, alternated step by step (which goes first alternates too), the policy fixed
    (no training), the prefix cache reset between steps as a hand-off does. A shared machine's load
    then moves both modes alike, which separate training runs cannot promise."""
    import tempfile

    from hybridrl.core import environ

    environ.setup()
    from hybridrl.core import config as C, launch
    from hybridrl.data import prompts, rewards
    from hybridrl.engines.rollout import EngineSizing, Rollout
    from hybridrl.observe.progress import Phases
    from hybridrl.run import resolve
    from hybridrl.run.collect import Collector

    world = launch.init_distributed()
    flags = dict(zip(extra[::2], extra[1::2]))
    over = {"data.path": "longtail", "train.seed": seed, **{k.lstrip("-"): v for k, v in flags.items()}}
    cfgs = {m: resolve.run_config(C.load(None, {**over, "rollout.partial": m}), world) for m in ("off", "on")}
    res = cfgs["on"]  # its KV cache holds the groups in flight
    cuda = world.device.type == "cuda"  # a GPU (scripts/lease.py's partial stage): vLLM alone, a fixed share of it
    rollout = Rollout(
        res.cfg,
        res.model_path,
        on_cpu=not cuda,
        eos_token_id=res.tokenizer.eos_token_id,
        rank=0,
        sizing=EngineSizing("0.3", 0, 0, "off") if cuda else None,
    )
    scorer = rewards.Scorer(res.cfg.reward, rank=0)
    scorer.run_dir = Path(tempfile.mkdtemp(prefix="bench-partial-"))
    cols = {
        m: Collector(r.cfg, rollout, scorer, r.tokenizer, r.prompts, prompts.Sampler(len(r.prompts), seed), world, [])
        for m, r in cfgs.items()
    }
    got = {m: {"tokens": 0.0, "seconds": 0.0, "steps": []} for m in cols}
    # vLLM's engine steps (decode iterations) per training step: what partial rollouts cut. A GPU's decode
    # step costs about the same at any batch up to hundreds of sequences; this CPU's grows with the batch
    engine = rollout.llm.llm_engine
    engine_step, calls = engine.step, []

    def counted():
        calls.append(engine.get_num_unfinished_requests())
        return engine_step()

    engine.step = counted
    for step in range(1, steps + 1):
        for m in ("off", "on") if step % 2 else ("on", "off"):
            ph = Phases(step)
            calls.clear()
            ro = cols[m].batch(step, ph)
            rollout.llm.reset_prefix_cache()
            if step > 1:  # the first step pays the engine's first calls
                got[m]["tokens"] += ro.metrics["rollout_tokens"]
                got[m]["seconds"] += ph["generate"]
            got[m]["steps"].append(
                (
                    ph["generate"],
                    ro.metrics["rollout_tokens"],
                    len(ro.prompts),
                    len(calls),
                    sum(calls) / max(len(calls), 1),
                )
            )
    rollout.close()
    scorer.close()
    # the median step's tokens/s as well: a load spike from another job lands in one mode's step
    return {
        m: {
            "rollout_tok_s": g["tokens"] / g["seconds"],
            "generate_s": g["seconds"] / max(steps - 1, 1),
            "median_tok_s": statistics.median(s[1] / s[0] for s in g["steps"][1:]),
            "engine_steps": statistics.mean(s[3] for s in g["steps"][1:]),
            "batch": statistics.mean(s[4] for s in g["steps"][1:]),
            "steps": g["steps"],
        }
        for m, g in got.items()
    }


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, t, acc in curve if acc >= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument(
        "--target",
        type=float,
        default=0.5,
        help="held-out accuracy for the time-to-accuracy column (the warmed model starts near 0.4)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_partial")
    ap.add_argument(
        "--generate-only",
        action="store_true",
        help="rollout throughput alone: both modes alternated in one process, no training",
    )
    args, extra = ap.parse_known_args()  # the rest: flags for both runs, e.g. --log.eval_size 128
    extra = [x for k, v in SHAPE.items() if k not in extra for x in (k, v)] + extra
    if args.generate_only:
        g = generate_only(args.steps, args.seeds[0], extra)
        ratio = g["on"]["rollout_tok_s"] / g["off"]["rollout_tok_s"]
        print(
            f"\ngeneration alone, {args.steps} steps each, alternated in one process (a shared machine: its load "
            "moves both alike)"
        )
        print(
            f"{'partial':8} {'generate ms/step':>17} {'rollout tok/s':>14} {'median step tok/s':>18} "
            f"{'engine steps/step':>18} {'mean batch':>11}"
        )
        for m in ("off", "on"):
            print(
                f"{m:8} {g[m]['generate_s'] * 1e3:17.0f} {g[m]['rollout_tok_s']:14.0f} {g[m]['median_tok_s']:18.0f} "
                f"{g[m]['engine_steps']:18.1f} {g[m]['batch']:11.1f}"
            )
        print(
            f"on / off: rollout tokens/s x{ratio:.2f}, median step's x"
            f"{g['on']['median_tok_s'] / g['off']['median_tok_s']:.2f}; engine steps per step "
            f"x{g['off']['engine_steps'] / g['on']['engine_steps']:.2f} fewer"
        )
        record(
            "partial_rollout",
            {"task": "longtail", "mode": "generate_only", "steps": args.steps, "seed": args.seeds[0], "flags": extra},
            {"off": g["off"], "on": g["on"], "rollout_tok_s_ratio": ratio},
            note="both modes alternated step by step on one engine, policy fixed",
        )
        return 0
    got = []
    for seed in args.seeds:
        for mode in ("off", "on"):
            got.append(run(mode, seed, args.steps, args.eval_every, args.out, extra))
            print(f"  done: partial {mode}, seed {seed}, {got[-1]['wall_s']:.0f} s", flush=True)
    by = {m: [g for g in got if g["mode"] == m] for m in ("off", "on")}
    mean = {
        m: {
            k: statistics.mean(g[k] for g in by[m])
            for k in (
                "step_s",
                "generate_s",
                "rollout_tok_s",
                "samples_s",
                "response_len",
                "truncated_frac",
                "stale_token_frac",
                "reward_last20",
            )
        }
        for m in by
    }
    for m in by:
        tt = [time_to(g["curve"], args.target) for g in by[m]]
        mean[m]["time_to_target_s"] = statistics.mean(tt) if all(t is not None for t in tt) else None
        mean[m]["final_acc"] = statistics.mean(g["curve"][-1][2] for g in by[m])
    print(
        f"\npartial rollouts on the long-tailed task: {args.steps} steps, seeds {args.seeds}; "
        "a machine shared with other jobs: compare the rows of this run only"
    )
    head = (
        f"{'partial':8} {'step ms':>8} {'generate ms':>12} {'rollout tok/s':>14} {'samples/s':>10} "
        f"{'resp len':>9} {'stale tok':>10} {'t to ' + format(args.target, '.0%'):>9} {'final acc':>10}"
    )
    print(head)
    for m in ("off", "on"):
        x = mean[m]
        tt = "-" if x["time_to_target_s"] is None else f"{x['time_to_target_s']:.0f} s"
        print(
            f"{m:8} {x['step_s'] * 1e3:8.0f} {x['generate_s'] * 1e3:12.0f} {x['rollout_tok_s']:14.0f} "
            f"{x['samples_s']:10.0f} {x['response_len']:9.1f} {x['stale_token_frac']:10.1%} {tt:>9} "
            f"{x['final_acc']:10.1%}"
        )
    ratio = mean["on"]["rollout_tok_s"] / mean["off"]["rollout_tok_s"]
    print(
        f"on / off: rollout tokens/s x{ratio:.2f}, "
        f"trained samples/s x{mean['on']['samples_s'] / mean['off']['samples_s']:.2f}, "
        f"step time x{mean['on']['step_s'] / mean['off']['step_s']:.2f}"
    )
    print(
        "\nheld-out accuracy (greedy, log.eval_size prompts) at each evaluation: step, engine-clock seconds, accuracy"
    )
    for g in got:
        print(f"  {g['mode']:3} seed {g['seed']}: " + "  ".join(f"{s}/{t:.0f}s/{a:.1%}" for s, t, a in g["curve"]))
    record(
        "partial_rollout",
        {"task": "longtail", "steps": args.steps, "seeds": args.seeds, "eval_every": args.eval_every, "flags": extra},
        {
            "off": mean["off"],
            "on": mean["on"],
            "rollout_tok_s_ratio": ratio,
            "curves": [{k: g[k] for k in ("mode", "seed", "curve")} for g in got],
        },
        note="the two modes run one after the other on the same machine; a shared machine's load moves both",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
