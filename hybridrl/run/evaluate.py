"""Held-out evaluation: the loop's (at the start, every log.eval_every steps, at the end) and
`hybridrl eval RUN_DIR_OR_MODEL --data heldout.jsonl` on its own.

Greedy completions of the held-out prompts (sharded over ranks), scored by the run's reward:
`acc` (logged as heldout_acc and eval/pass@1) is the share of rewards >= log.eval_threshold
(1.0: "correct" for the 0/1 verifiers), `eval/mean_reward` the mean, which is what a continuous or
weighted reward should be read by. With log.eval_n > 0 also `eval/mean@n`: n samples per prompt
at log.eval_temperature, with their own seeds so training's sampling stream is untouched.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from pathlib import Path

from hybridrl.core import launch
from hybridrl.run.collect import images_of, single_turn_greedy


def heldout_eval(
    cfg, rollout, scorer, tokenizer, heldout: list, world, step: int, greedy=None
) -> tuple[float, dict, list[dict]]:
    """(accuracy, {eval/mean_reward, eval/mean@n, eval/n_samples}, a few sample rows of this rank).
    greedy(prompts) -> (texts, environment rewards): the collector's, whose greedy completions are
    whole episodes when an environment is set; by default vLLM's greedy single answers."""
    shard = heldout[world.rank :: world.size]
    thr = cfg.log.eval_threshold
    texts, env_rewards = (
        greedy or functools.partial(single_turn_greedy, rollout, tokenizer, max_tokens=cfg.rollout.max_new_tokens)
    )(shard)
    scores = scorer.score([p.text for p in shard], texts, [p.answer for p in shard], {"eval_step": step})
    scores = [s + r for s, r in zip(scores, env_rewards)]
    sums = launch.all_sum([sum(s >= thr for s in scores), float(sum(scores)), len(scores)])
    acc = sums[0] / max(sums[2], 1)
    extra = {"eval/mean_reward": sums[1] / max(sums[2], 1)}
    rows = [
        dict(prompt=p.text, completion=t, answer=p.answer, reward=float(s)) for p, t, s in zip(shard, texts, scores)
    ][: cfg.log.eval_samples]
    if cfg.log.eval_n:
        gen = rollout.generate(
            [p.ids for p in shard],
            cfg.log.eval_n,
            images=images_of(shard),
            temperature=cfg.log.eval_temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.train.seed + step,
        )  # an empty shard too (a TP group's ranks ask together)
        samples = [s for finished in gen for s in finished]
        texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
        src = [shard[s.prompt_idx] for s in samples]
        scores = scorer.score([p.text for p in src], texts, [p.answer for p in src], {"eval_step": step})
        hits = launch.all_sum([sum(s >= thr for s in scores), len(scores)])
        extra.update({"eval/mean@n": hits[0] / max(hits[1], 1), "eval/n_samples": int(hits[1])})
    return acc, extra, rows


class Evaluator:
    """The loop's held-out evaluation: `evaluator(step)` wakes vLLM's KV cache, evaluates (greedy
    episodes through the collector when an environment is set), logs the accuracy and a few
    samples (samples.jsonl); returns the accuracy, None without a held-out split."""

    def __init__(self, cfg, rollout, scorer, tokenizer, heldout: list, world, run, collector):
        self.cfg, self.rollout, self.scorer, self.tokenizer = cfg, rollout, scorer, tokenizer
        self.heldout, self.world, self.run, self.collector = heldout, world, run, collector

    def __call__(self, step: int) -> float | None:
        if not self.heldout:
            return None
        from hybridrl.core import faults

        faults.progress(step, "eval")
        start = time.perf_counter()
        self.rollout.wake(["kv_cache"])
        acc, extra, rows = heldout_eval(
            self.cfg,
            self.rollout,
            self.scorer,
            self.tokenizer,
            self.heldout,
            self.world,
            step,
            greedy=self.collector.greedy,
        )
        self.run.samples(step, rows)
        self.run.eval(step, acc, extra, seconds=time.perf_counter() - start)
        return acc


def run(target: str, cfg) -> dict:
    """`hybridrl eval`: load the model (a run directory's newest checkpoint, exported to a temporary
    HF directory, or a model directory / hub name), build vLLM alone and evaluate once."""
    from hybridrl.core import environ
    from hybridrl.core.config import UserError
    from hybridrl.data import images, prompts, rewards
    from hybridrl.engines.rollout import Rollout
    from hybridrl.run import export, resolve

    environ.setup()
    world = launch.init_distributed()
    on_cpu = world.device.type == "cpu"
    with tempfile.TemporaryDirectory(prefix="hybridrl-eval-") as tmp:
        model_dir = None
        if Path(target).is_dir() and not (Path(target) / "config.json").exists():  # a run directory
            export.export(target, tmp, trust_remote_code=cfg.model.trust_remote_code)  # today's flag
            model_dir = tmp
        cfg, path, _ = resolve.eval_config(cfg, on_cpu, world.size, model_dir)  # vLLM alone on the device
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        vision = images.Vision.of(path, tokenizer)
        heldout, dropped = prompts.encode(
            prompts.load_rows(cfg.data, "heldout"), tokenizer, cfg.data, "held-out", vision
        )
        heldout = heldout[: cfg.log.eval_size or None]
        if not heldout:
            raise UserError("no held-out prompts to evaluate: pass --data FILE (or set data.heldout_path)")
        rollout = Rollout(
            cfg,
            path,
            on_cpu=on_cpu,
            eos_token_id=tokenizer.eos_token_id,
            rank=world.rank,
            local_rank=world.local_rank,
            tp=launch.tp_groups(world, cfg.rollout.tensor_parallel_size),
        )
        scorer = rewards.Scorer(cfg.reward, rank=world.rank)
        try:
            acc, extra, rows = heldout_eval(cfg, rollout, scorer, tokenizer, heldout, world, step=0)
        finally:
            scorer.close()
            rollout.close()
    out = {
        "model": target,
        "prompts": len(heldout),
        "dropped": dropped,
        "accuracy": acc,
        "threshold": cfg.log.eval_threshold,
        **extra,
        "samples": rows,
    }
    if world.main:
        mean_n = f", mean@{cfg.log.eval_n} {extra['eval/mean@n']:.1%}" if cfg.log.eval_n else ""
        print(
            f"held-out: {len(heldout)} prompts, greedy accuracy {acc:.1%} (reward >= {cfg.log.eval_threshold:g}), "
            f"mean reward {extra['eval/mean_reward']:.3f}{mean_n}",
            flush=True,
        )
        print(json.dumps(out), flush=True)
    return out
