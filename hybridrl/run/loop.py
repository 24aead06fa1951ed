"""The RL loop: prompts -> rollout -> rewards -> advantages -> train -> weight hand-off.

One function, `train(cfg)`, read top to bottom. Each rank runs it with its own vLLM engine and
its own DeepSpeed engine on the same device; the phase order, sleep/wake included, lives
here and nowhere else.
"""

from __future__ import annotations

import functools
import logging
import random
import time

import numpy as np
import torch

from hybridrl.algorithms import advantages, estimator
from hybridrl.core import environ, faults, launch, recipe
from hybridrl.core.canaries import distribution_metrics
from hybridrl.core.config import Config, torch_dtype
from hybridrl.cycle import engine_cycle, sync
from hybridrl.data import partial, rewards
from hybridrl.data.batch import Batch
from hybridrl.data.prompts import Sampler
from hybridrl.engines import reward_model
from hybridrl.engines.critic import Critic
from hybridrl.engines.reference import Reference, load_teacher
from hybridrl.engines.rollout import Rollout
from hybridrl.engines.seams import Engines
from hybridrl.engines.trainer import Trainer
from hybridrl.observe.progress import Phases, RunLog
from hybridrl.run import checkpoint, resolve, signals
from hybridrl.run.collect import Collector
from hybridrl.run.evaluate import Evaluator

log = logging.getLogger("hybridrl")


def train(cfg: Config) -> dict:
    """Run RL training as configured; returns the summary (accuracy before/after, timings)."""
    environ.setup()
    world = launch.init_distributed(timeout_s=2 * cfg.train.watchdog_s)
    on_cpu = world.device.type == "cpu"
    engine_cycle.check(cfg, cuda=not on_cpu)  # allocator settings that would break vLLM's sleep mode
    # the machine's 'auto' settings, the model's recipe, the memory plan, the steps from the data
    res = resolve.run_config(cfg, world)
    cfg, model_path, info, tokenizer, prompts, heldout = (
        res.cfg,
        res.model_path,
        res.info,
        res.tokenizer,
        res.prompts,
        res.heldout,
    )
    seed_everything(cfg.train.seed + world.rank)
    tp = launch.tp_groups(world, cfg.rollout.tensor_parallel_size)  # every rank keeps its own prompts

    sampler = Sampler(len(prompts), cfg.train.seed)
    resumed = res.resumed  # None: a fresh run; else the run continues in that run's directory
    scorer = rewards.Scorer(cfg.reward, rank=world.rank)  # a bad reward.fn fails here; its workers start now
    run = RunLog(
        cfg,
        world,
        recipe.describe(
            cfg, info, on_cpu=on_cpu, n_prompts=len(prompts), engines={**res.layout.recipe(cfg), **res.chat}
        ),
        resume_step=resumed.step if resumed else None,
    )  # keeps its rows up to the checkpoint
    run.data({"data/prompts": len(prompts), **{f"data/{k}": v for k, v in res.dropped.items()}})
    scorer.run_dir = run.dir  # where reward_dead_letter.jsonl goes
    saver = checkpoint.Saver(cfg, run.dir, world, tokenizer)

    trainer = Trainer(
        cfg,
        model_path,
        device=world.device,
        dtype=torch_dtype(cfg.model.dtype),
        attn_implementation=cfg.model.attn_implementation,
    )
    engine_kw = dict(
        device=world.device, dtype=torch_dtype(cfg.model.dtype), attn_implementation=cfg.model.attn_implementation
    )
    ref = Reference.load(cfg, model_path, trainer=trainer, **engine_kw)  # None when kl_coef == 0; LoRA: the base
    teacher = load_teacher(cfg, trainer=trainer, **engine_kw)  # None unless algo.teacher (distillation)
    critic = Critic(cfg, model_path, **engine_kw) if estimator(cfg.algo.advantage).critic else None
    reward_models = reward_model.load_all(cfg, world.device)  # rm: terms; they score while vLLM is awake
    engines = Engines(trainer, critic=critic, reference=ref, teacher=teacher, reward_models=reward_models)
    # vLLM's memory, the states' (measured now the trainer is built; the config stays as resolved)
    sizing = engine_cycle.plan_rollout(
        cfg,
        engines,
        cuda=not on_cpu,
        main=world.main,
        world_size=world.size,
        visitors=sum(m.nbytes for _, _, m in reward_models),
    )
    rollout = engines.rollout = Rollout(
        cfg,
        model_path,
        on_cpu=on_cpu,
        eos_token_id=tokenizer.eos_token_id,
        rank=world.rank,
        local_rank=world.local_rank,
        tp=tp,
        sizing=sizing,
    )  # tp: the ranks that share its engine
    seqs, images = sync.probe_inputs(
        (heldout or prompts)[:8], tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len
    )  # held-out prompts with their answers; a vision-language model's with their images
    probe = sync.Probe(
        seqs,
        cfg.train.probe_tol or sync.PROBE[cfg.model.dtype][1],
        cfg.train.probe_action,
        stat=sync.PROBE[cfg.model.dtype][0],
        every=cfg.train.probe_every,
        calibrated=bool(cfg.train.probe_tol),
        images=images,
        vision=res.vision,
    )
    collector = Collector(cfg, rollout, scorer, tokenizer, prompts, sampler, world, reward_models, res.vision)

    evaluate = Evaluator(cfg, rollout, scorer, tokenizer, heldout, world, run, collector)  # held-out split
    # trainer -> vLLM: offload, wake weights, hand-off, wake KV cache (the order, and why: engine_cycle.py)
    hand_off = functools.partial(engine_cycle.hand_off, engines, cfg=cfg, cuda=not on_cpu, sizing=sizing)

    start = time.perf_counter()  # engines are up: the clock of train.max_minutes starts here
    if resumed:  # weights (handed to vLLM and probed), optimizer, data cursor, RNG, history
        engine_cycle.release(engines, None, cfg=cfg)  # the states back to load into
        done, acc_before = resumed.restore(engines, sampler, probe, run, hand_off, buffer=collector.buffer)
        start -= resumed.state["history"]["elapsed_s"]
    else:
        done, acc_before = 0, evaluate(0)
        run.data(probe.calibrate(trainer, rollout))  # the engines' rounding gap on the weights both loaded
    last_eval, step, stop_signal = start, done, 0
    watchdog = faults.Watchdog(cfg.train.watchdog_s, world.rank, world.size, run.dir)  # a stalled rank stops the run
    # SIGTERM/SIGINT: finish the step, save, exit; a device OOM or a dead vLLM engine: one line naming the phase
    with signals.StopSignals(world.main) as stop, watchdog, engine_cycle.failures(cfg, rollout, sizing):
        for step in range(done + 1, cfg.train.steps + 1):
            phases = Phases(step)
            # 1. rollout and rewards: n samples per prompt (this rank's share), each scored as it
            #    finishes while vLLM generates the rest; DAPO's dynamic sampling and overlong shaping
            ro = collector.batch(step, phases)
            samples = ro.samples
            engine_cycle.release(engines, phases, cfg=cfg)  # vLLM sleeps, trainers reload
            # 2. the sampling policy's, the reference's and the critic's view; advantages
            R = ro.rewards  # [P, n]
            batch = Batch.from_rows(
                ro.prompt_ids(),  # as vLLM ran them: a vision-language prompt with its images expanded
                [s.token_ids for s in samples],
                [s.logprobs for s in samples],
                [0.0] * len(samples),
                [s.loss_mask for s in samples],  # multi-turn: environment tokens carry no loss
                [s.routes for s in samples],  # MoE: vLLM's experts, for routing replay
                ro.row_pixels(),  # a vision-language model's images, as the trainer's forward takes them
            )
            if collector.buffer:  # partial rollouts: the tokens an older policy sampled (data/partial.py)
                batch.stale = partial.stale_mask(samples, partial.version_of(step), batch.loss_mask)
            if trainer.needs_old_logprobs:  # several updates per rollout, KL in the reward, LoRA dropout with IS
                with phases("old_logprob"):
                    batch.logp_old = trainer.old_logprobs(batch)  # vLLM's, or a trainer forward
            if batch.stale is not None:  # the IS weights' spread on stale and on fresh tokens
                ro.metrics.update(partial.is_metrics(batch.logp_old, batch.logp_rollout, batch.loss_mask, batch.stale))
            for phase, scores, model in engines.scorers():  # the reference (KL), the teacher (distillation)
                with phases(phase):
                    got = model.logprobs(batch, cfg.rollout.temperature)
                    for name, value in zip(scores, got if isinstance(got, tuple) else (got,)):
                        setattr(batch, name, value)
            if critic:
                with phases("values"):
                    batch.values = critic.values(batch)
            # [P * n] or [P * n, T]
            batch.advantages, batch.returns, adv_metrics = advantages.estimate(
                cfg.algo, R, batch, all_sum=launch.all_sum, all_max=launch.all_max
            )
            batch.advantages[ro.masked] = 0.0  # overlong-filtered samples and a filler group carry no gradient
            signal = advantages.nonzero_advantage(batch.advantages)  # [P * n] bool
            # 3. train on the samples that carry a gradient (equal-reward groups have A == 0, but
            # with the KL or the teacher's divergence in the loss every unmasked sample still has one)
            skip = cfg.algo.skip_zero_advantage and not advantages.gradient_without_advantage(cfg.algo)
            keep = signal.clone() if skip else ~ro.masked
            keep[0] |= not keep.any()  # one zero-advantage row keeps this rank in the collectives
            batch = batch.select(keep.nonzero().flatten())
            with phases("train"):
                metrics = trainer.step(batch)
            if critic:
                with phases("critic"):
                    metrics.update(critic.step(batch))
            metrics.update(adv_metrics)
            # 4. hand the new weights to vLLM
            metrics.update(hand_off(phases))  # sync/bytes, sync/tensors
            if probe.due(step, metrics):  # the first hand-off, every train.probe_every, and on drift
                with phases("probe"):
                    metrics.update(probe(trainer, rollout, step))

            metrics.update(ro.metrics)  # reward, solve_rate, reward_errors/timeouts, dropped_prompts, ds_*
            metrics.update(step_metrics(ro, batch, signal, phases, samples, time.perf_counter() - start))
            run.step(step, metrics)
            now = time.perf_counter()
            if step != cfg.train.steps and (
                (cfg.log.eval_every and step % cfg.log.eval_every == 0)
                or (cfg.log.eval_every_s and launch.all_max(now - last_eval) >= cfg.log.eval_every_s)
            ):
                evaluate(step)
                last_eval = now
            elapsed = launch.all_max(time.perf_counter() - start)
            out_of_time = bool(cfg.train.max_minutes) and elapsed > cfg.train.max_minutes * 60
            stop_signal = stop.requested()  # all ranks agree
            last = out_of_time or bool(stop_signal) or step == cfg.train.steps
            if saver.due(step, final=last):  # a failed save is reported; the run goes on (ends non-zero if last)
                saver.save(
                    step,
                    engines,
                    sampler,
                    probe,
                    dict(acc_before=acc_before, last_acc=run.last_acc, elapsed_s=elapsed),
                    final=last,
                    buffer=collector.buffer,
                )
            if out_of_time or stop_signal:
                break
    # a signal asks for a quick exit (preemption grace periods are short): no final evaluation
    acc_after = run.last_acc if stop_signal else evaluate(step)
    summary = {
        "heldout_acc_before": acc_before,
        "heldout_acc_after": acc_after,
        "steps": step,
        "minutes": (time.perf_counter() - start) / 60,
        "run_dir": str(run.dir),
        "eval/pass@1": acc_after,
        **run.last_sampled,
    }
    if stop_signal:
        summary.update(stop.summary(stop_signal, step, saver.last, run.dir))
    if saver.failures:
        summary.update(checkpoint_failures=saver.failures)
    if saver.unsaved:  # the last save failed: the newest checkpoint is older than the run's end
        summary.update(exit_code=1, checkpoint_error=saver.unsaved)
    run.close(summary)
    scorer.close()
    rollout.close()
    return summary


def step_metrics(ro, batch: Batch, signal: torch.Tensor, phases: Phases, samples: list, elapsed_s: float) -> dict:
    """What a step logs beside the trainer's and the collector's metrics: throughput, the share of
    samples with a gradient (over all ranks), the phases' times and memory, distributions."""
    n_train = launch.all_sum([int(batch.lengths.sum()), float(signal.sum()), signal.numel()])
    return dict(
        signal_frac=n_train[1] / n_train[2],
        rollout_tok_s=ro.metrics["rollout_tokens"] / max(phases["generate"], 1e-9),
        train_tok_s=n_train[0] / max(phases["train"], 1e-9),
        elapsed_s=elapsed_s,
        **{f"time/{k}": v for k, v in phases.items()},
        **phases.memory,  # mem/<phase>/*_gb after every phase: CUDA only
        **distribution_metrics(response_len=[len(s.token_ids) for s in samples], reward=ro.rewards),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
