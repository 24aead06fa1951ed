"""The hybrid engine's memory life cycle: the order in which the trainer and vLLM take and give
back the device, in one place. The loop calls `hand_off` after training and `release` after
generating; `plan_rollout` sizes vLLM once, before it is built.

    offload trainer -> wake weights -> hand-off -> free staging, empty cache -> wake KV
        -> generate -> sleep -> reload trainer -> train -> (again)

Why this order: the trainer's states leave the device before vLLM's memory returns, and vLLM's
weights wake before its KV cache, so the two engines' peaks never overlap (waking both while the
trainer still holds memory is the most reported colocation OOM: NeMo-RL#191, vllm#15254). The KV
cache wakes only after the hand-off: waking it restores nothing of the weights, so weights
synced before it cannot be overwritten by a stale CPU copy (TRL#5312). Every hand-off sends all
parameters, which is what a level-2 sleep (weights discarded) requires (with LoRA it sends the
whole adapter, and vLLM sleeps at level 1, keeping its base weights: recipe.resolve);
`Rollout.wake` refuses to wake the KV cache over discarded weights. Expandable segments are off
while vLLM's pool is touched (memory.py). On CPU the sleep, wake, offload and allocator verbs are
no-ops; the order is the same.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext

import torch

from hybridrl.core import faults, launch, memory
from hybridrl.core.config import Config, ConfigError, UserError
from hybridrl.cycle import sync
from hybridrl.engines import deepspeed_compat, vllm_compat
from hybridrl.engines.rollout import EngineSizing
from hybridrl.engines.seams import Engines, RolloutEngine


def _phase(phases, name: str):
    return phases(name) if phases is not None else nullcontext()


def hand_off(engines: Engines, phases=None, *, cfg: Config, cuda: bool, sizing: EngineSizing | None = None) -> dict:
    """Trainer -> vLLM, leaving vLLM awake and ready to generate. Returns what was handed over
    (sync/tensors, sync/bytes: with LoRA, the adapter's only). `sizing`: plan_rollout's (None: as
    configured)."""
    trainer, rollout = engines.trainer, engines.live_rollout
    with _phase(phases, "offload"):
        if (sizing or EngineSizing.of(cfg)).offload_states != "off":  # plan_rollout decided (on GPU with the planner)
            trainer.offload()  # optimizer states, fp32 master weights, gradients
        for resident in engines.residents():  # the critic: all of it, it takes no part in the hand-off
            resident.offload()
    with memory.vllm_pool(cuda):
        with _phase(phases, "wake_weights"):
            rollout.wake(["weights"])
        with _phase(phases, "sync"):
            sent = sync.push_weights(trainer, rollout, cfg.train.sync_bucket_mb)
            if cfg.train.offload_params:
                trainer.offload(params=True)  # the hand-off has read them; back at reload
            memory.empty_cache(cuda)  # gather and staging buffers go back before the KV cache comes
        with _phase(phases, "wake_kv"):
            rollout.wake(["kv_cache"])
    return sent


def release(engines: Engines, phases, *, cfg: Config) -> None:
    """vLLM -> trainer, after generating: vLLM gives its memory back, the trainer takes its
    states back."""
    with _phase(phases, "sleep"):
        engines.live_rollout.sleep(cfg.rollout.sleep_level)
    with _phase(phases, "reload"):
        engines.trainer.reload()
        for resident in engines.residents():
            resident.reload()


def check(cfg: Config, cuda: bool) -> None:
    """At start, before any engine: an allocator setting that sleep mode cannot live with fails
    here with what to change."""
    if cuda:
        memory.check_alloc_conf(os.environ, cfg, can_toggle=memory.can_toggle())


def plan_rollout(
    cfg: Config, engines: Engines, *, cuda: bool, main: bool, world_size: int = 1, visitors: int = 0
) -> EngineSizing:
    """Size vLLM before it is built, as it will run, and decide where the trainer's states live
    while it generates. With rollout.gpu_memory_utilization=auto (GPU): measure the device with
    the trainer's states on it and offloaded, plan (memory.plan: weights, a KV cache for the
    step's sequences, activations), keep the states on the device if they fit beside vLLM, print
    the plan. Returns the decisions (a utilization, the KV cache's MiB, offload_states on/off; on
    GPU max_num_seqs, memory.engine_seqs) as an EngineSizing the rollout engine and the hand-off
    read: the resolved config is frozen, and stays as the run recorded it. The critic always
    leaves: it takes no part in generating. `visitors`: device bytes of the reward models, which
    score while vLLM is awake; the plan keeps them free."""
    trainer = engines.trainer
    for resident in engines.residents():
        resident.offload()
    per_rank = launch.all_gather(memory.host_memory())
    if main:
        print(memory.describe_host(per_rank), flush=True)
    t, r = cfg.train, cfg.rollout
    seqs_at_once = r.max_num_seqs
    if cuda and not seqs_at_once:  # vLLM runs a step's or an evaluation's sequences at once (memory.sampler_bytes)
        seqs_at_once = memory.engine_seqs(cfg, world_size, r.tensor_parallel_size)  # the group's
    if not cuda or r.gpu_memory_utilization != "auto":  # the user sized vLLM (or CPU: rollout.kv_cache_mb)
        offload = "off" if t.offload_states == "off" else "on"
        if offload == "on":
            trainer.offload()
        return EngineSizing(r.gpu_memory_utilization, r.kv_cache_mb, seqs_at_once, offload)
    if r.sleep_level == 0:  # vLLM would keep the planned memory while the trainer reloads
        raise ConfigError(
            "rollout.gpu_memory_utilization=auto plans for vLLM sleeping while the trainer trains; with "
            "rollout.sleep_level=0 set a fraction that leaves room for the trainer"
        )
    hf = trainer.hf
    b = trainer.compute_dtype.itemsize  # vLLM's, not the weights' (float32 under train.precision=amp)
    # a rank's engine holds its tensor-parallel shard of the weights; its KV share covers the group's
    # sequences (tp x a rank's) at 1/tp of the heads: a rank's step at full width, as kv_cache_need counts
    weights = sum(deepspeed_compat.full_numel(p) for p in hf.parameters()) * b // r.tensor_parallel_size
    need = (r.kv_cache_mb << 20) or memory.kv_cache_need(cfg, hf.config, world_size, b)
    # where memory is short the KV cache may shrink to the longest sequences running, and the step takes waves
    seqs = memory.step_seqs(cfg, world_size)
    seq = r.max_model_len * memory.kv_bytes_per_token(hf.config, b)
    # with the states kept, what is free now less the Adam moments the first step will add
    free_kept = memory.free_memory()[0] - trainer.pending_state_bytes() if t.offload_states != "on" else 0
    trainer.offload(params=t.offload_params)  # measured as it will run: the parameters leave too when set
    free_offloaded, total = memory.free_memory()
    # one plan for every rank: what the fullest device has free (ranks differ by their neighbours' use)
    free_kept, free_offloaded = (int(-launch.all_max(-free)) for free in (free_kept, free_offloaded))
    plan = memory.plan(
        total,
        free_kept,
        free_offloaded,
        margin=r.memory_margin_mb << 20,
        weights=weights,
        need=need,
        offload=t.offload_states,
        visitors=visitors,
        sampler=memory.sampler_bytes(seqs_at_once, memory.vocab_size(hf.config)),
        asleep=_asleep_bytes(cfg, hf, b, seqs_at_once),
        floor=memory.kv_floor(seqs, seq),
        seqs=seqs,
        seq=seq,
    )
    if not plan.offload:
        trainer.reload()
    if main:  # the engine's max_num_seqs too: `hybridrl plan` prints the same figure (a TP group's)
        print(f"{plan.describe()}; rollout.max_num_seqs={seqs_at_once}", flush=True)
    fraction = math.floor(plan.utilization * 1e4) / 1e4  # rounded down: never more than is free
    return EngineSizing(str(fraction), plan.kv >> 20, seqs_at_once, "on" if plan.offload else "off")


def _asleep_bytes(cfg: Config, hf, b: int, max_num_seqs: int) -> int:
    """vLLM's graph pool and buffers that no sleep releases, as `hybridrl plan` counts them
    (plan.asleep_bytes); 0 for a config the plan cannot read (it then plans by measurement alone)."""
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape

    r = cfg.rollout
    try:
        shape = Shape.from_config(hf.config.to_dict())
    except (AttributeError, ConfigError):
        return 0
    return plan.asleep_bytes(shape, b, max_num_seqs, r.tensor_parallel_size, not r.enforce_eager)


class EngineFailure(UserError):
    """The device ran out of memory, or vLLM's engine died, in a phase of the step (one line)."""


# the phase an engine failure happened in -> who held the memory, and the knob that gives it more room
_VLLM = (
    "vLLM",
    "raise rollout.memory_margin_mb or set rollout.gpu_memory_utilization to a smaller fraction "
    "(a smaller rollout.kv_cache_mb, rollout.max_num_seqs or prompts_per_step x rollout.n also help)",
)
_TRAINER = (
    "the trainer",
    "lower train.max_tokens_per_micro_batch (or turn on model.gradient_checkpointing / train.offload_states on)",
)
KNOBS = {
    "wake_weights": _VLLM,
    "wake_kv": _VLLM,
    "generate": _VLLM,
    "reward": _VLLM,
    "reward_model": _VLLM,
    "sync": ("the hand-off", "lower train.sync_bucket_mb (or raise rollout.memory_margin_mb)"),
    "probe": _VLLM,
    "eval": _VLLM,
    "offload": _TRAINER,
    "sleep": _VLLM,
    "reload": _TRAINER,
    "old_logprob": _TRAINER,
    "ref_logprob": _TRAINER,
    "values": _TRAINER,
    "train": _TRAINER,
    "critic": _TRAINER,
}


def failure_line(
    e: BaseException, cfg: Config, step: int, phase: str, sizing: EngineSizing | None = None
) -> str | None:
    """One line for a device out-of-memory or a dead vLLM engine: the phase, the memory plan (`sizing`,
    plan_rollout's; else as configured) and the knob; None for any other error."""
    r, t, size = cfg.rollout, cfg.train, sizing or EngineSizing.of(cfg)
    plan = (
        f"the plan: rollout.gpu_memory_utilization={size.gpu_memory_utilization}, rollout.kv_cache_mb="
        f"{size.kv_cache_mb}, rollout.memory_margin_mb={r.memory_margin_mb}, "
        f"train.offload_states={size.offload_states}, "
        f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch}"
    )
    who, knob = KNOBS.get(phase, ("the run", _VLLM[1] + "; or " + _TRAINER[1]))
    where = f"step {step}, phase {phase}" if step else f"phase {phase}"
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of device memory in {where} ({who}; {plan}): {knob}"
    if isinstance(e, vllm_compat.ENGINE_DEAD):
        return (
            f"vLLM's engine died in {where} (its own error is above; out of memory is the usual cause; "
            f"{plan}): {_VLLM[1]}"
        )
    return None


_FAILURES: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, *vllm_compat.ENGINE_DEAD)


@contextmanager
def failures(cfg: Config, rollout: RolloutEngine, sizing: EngineSizing | None = None):
    """Around the steps: a device out-of-memory or a dead vLLM engine becomes an EngineFailure naming the
    phase, the plan (`sizing`, plan_rollout's) and the knob, after the rollout side is closed (the
    hand-off's temporary directory and vLLM's engine process go with it)."""
    try:
        yield
    except _FAILURES as e:
        line = failure_line(e, cfg, *faults.last, sizing=sizing)
        try:
            rollout.close()
        except Exception:  # noqa: BLE001 (a dead engine may not close cleanly; the line matters more)
            pass
        raise EngineFailure(line) from e
