"""The trainer engine: the policy under DeepSpeed ZeRO-2/3, one per rank.

Verbs: `step(batch)`, `logprobs(batch)`, `offload()`, `reload()`, `named_parameters_for_sync()`.
It never imports the rollout engine; `sync.py` joins the two. The model it trains runs through
`policy.TokenLogprobs` (the LM head bypassed by the fused log-prob and loss kernels).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import deepspeed
import torch
from torch import nn

from hybridrl.algorithms import policy_loss
from hybridrl.core import faults, platform
from hybridrl.core.canaries import distribution_metrics
from hybridrl.core.config import Config, ConfigError, completion_budget, get
from hybridrl.core.families import vision_family
from hybridrl.core.launch import all_sum, world_size
from hybridrl.core.models import enable_checkpointing, freeze_vision, is_native, load_class, vision_frozen
from hybridrl.data import partial
from hybridrl.data.batch import Batch, per_token
from hybridrl.engines import deepspeed_compat, lora, routing, ulysses
from hybridrl.engines.policy import TokenLogprobs, kernel_provider, module_inputs, packs, share_prompt
from hybridrl.engines.zero_engine import (
    ds_config,
    from_pretrained,
    load_engine_checkpoint,
    lr_scheduler,
    minibatch_updates,
    plan_micro_batches,
    precision,
)
from hybridrl.kernels.ppo_loss import importance_ratio

log = logging.getLogger("hybridrl")
TAG = "ds"  # its DeepSpeed checkpoint's directory inside a hybridrl checkpoint


class Trainer:
    router: routing.Router | None = None  # MoE: the routers' hooks (_router); class defaults for stand-ins
    replay = False
    vision = None  # a vision-language model's family row (core/families.py)
    sp = ulysses.Group(None, 0, 1, 0)  # no sequence parallelism until __init__ says otherwise
    _part = slice(None)  # the last forward's loss tokens on this rank (all of them without it)

    def __init__(
        self, cfg: Config, model_path: str, *, device: torch.device, dtype: torch.dtype, attn_implementation: str
    ):
        self.cfg, self.device, self.platform = cfg, device, platform.current()
        self.teacher = None  # algo.distill_loss full: the teacher (reference.load_teacher), whose head the loss reads
        self.compute_dtype = dtype  # model.dtype: vLLM's weights and KV cache, the GEMMs' here
        dtype, autocast = precision(cfg, dtype)  # amp: float32 weights under bfloat16 autocast
        conf = ds_config(cfg, dtype == torch.bfloat16, self.platform)
        hf = from_pretrained(
            load_class(model_path, cfg.model.trust_remote_code),
            model_path,
            conf,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        freeze_vision(hf, cfg.model.train_vision)  # a vision-language model's tower: frozen by default
        # LoRA: the adapter is injected into `hf` in place; only its parameters train (see lora.py)
        self.peft = lora.attach(hf, cfg.model) if cfg.model.lora_rank else None
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(hf)
            if self.peft is not None:  # frozen embeddings: checkpointed blocks need an input that requires grad
                hf.enable_input_require_grads()
        self.router, self.replay = self._router(cfg, hf)  # MoE: routing replay and its metrics
        provider = kernel_provider(cfg)  # policy.layout decides alike for the run's printed recipe
        if provider == "liger" and (cfg.algo.dual_clip or cfg.algo.entropy_coef):
            raise ConfigError(
                "train.kernels=liger has no dual clip or entropy bonus: set algo.dual_clip and "
                "algo.entropy_coef to 0, or use train.kernels=auto"
            )
        self.packing = packs(cfg, provider, attn_implementation, native=is_native(type(hf)))
        if cfg.train.packing == "on" and not self.packing:
            log.info(
                "train.packing: not with kernels=%s / attention %s / %s; using padded rows",
                provider,
                attn_implementation,
                type(hf).__name__,
            )
        self.share_prompt = share_prompt(cfg, hf, provider, attn_implementation, self.packing)
        module = TokenLogprobs(hf, provider, cfg.train.logprob_chunk, completion_budget(cfg), autocast)
        self.sp = ulysses.new_groups(cfg.train.sequence_parallel_size)  # collective: every rank, in order
        if self.sp.size > 1:
            if not self.packing:
                raise ConfigError(
                    f"train.sequence_parallel_size={self.sp.size} cuts one packed row, which "
                    f"{type(hf).__name__} with attention {attn_implementation} cannot read: use "
                    "sdpa, eager or flash-attention and a transformers model, or "
                    "train.sequence_parallel_size 1"
                )
            ulysses.install(hf)
            module.sp = self.sp
        self.zero3 = cfg.train.zero_stage == 3
        self.host_optimizer = cfg.train.optimizer_offload == "on"  # DeepSpeed's offload_optimizer (ds_config)
        self.host_params = self.zero3 and cfg.train.param_offload == "on"
        if self.zero3:  # the head's weight is used by this module's forward, not by lm_head's
            deepspeed.zero.register_external_parameter(module, hf.get_output_embeddings().weight)
            deepspeed_compat.moe_leaf_modules(hf)  # ranks routing to other experts must gather alike
        self.engine, *_ = deepspeed.initialize(
            model=module,
            config=conf,
            lr_scheduler=lr_scheduler(cfg),
            model_parameters=[p for p in hf.parameters() if p.requires_grad],
        )
        if self.platform.one_pass_zero_step:  # one gradient pass for overflow + norm
            deepspeed_compat.fuse_overflow_check(self.engine.optimizer, world_size())
        self.hf = hf
        self.vision = vision_family(hf.config)  # None for a text model

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
                log.info(
                    "algo.routing_replay=on: %s is dense (no experts to route), nothing to replay", type(hf).__name__
                )
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
    def _forward(
        self, mb: Batch, temperature: float, loss: dict | None = None, distill: dict | None = None, ban: bool = True
    ):
        """Log-probs (and the loss) of mb's masked tokens, in the order of `mb.loss_mask`'s True
        entries whether packed or padded; `distill` (TokenLogprobs' distill=) with the loss."""
        if self.sp.size > 1:  # this rank's slice of the packed row, and of the per-token loss inputs
            s, args, kw = ulysses.module_inputs(mb, self.sp)
            self._part = s.part
            if loss is not None:
                loss = {k: v[s.part] if isinstance(v, torch.Tensor) else v for k, v in loss.items()}
            return self.engine(*args, temperature, loss, **kw)
        args, kw = module_inputs(mb, self.packing, self.share_prompt)
        return self.engine(*args, temperature, loss, **kw, distill=distill, ban=ban)

    def _plan(self, rows: Batch | None) -> list[torch.Tensor | None]:
        """Micro-batches of train.max_tokens_per_micro_batch tokens per rank: with sequence parallelism
        the group's ranks split each one, so it holds sequence_parallel_size times that. A sequence
        longer than that is refused: its activations would not be bounded by the budget."""
        budget, sp = self.cfg.train.max_tokens_per_micro_batch, self.sp.size
        longest = int(rows.lengths.max()) if rows else 0
        if longest > budget * sp:
            need = -(-longest // budget)
            raise ConfigError(
                f"a sequence of {longest} tokens is longer than train.max_tokens_per_micro_batch="
                f"{budget} x train.sequence_parallel_size={sp}: set train.sequence_parallel_size to "
                f"{need} or more (dividing --nproc; it splits a sequence over that many ranks) or raise "
                "train.max_tokens_per_micro_batch"
            )
        return plan_micro_batches(rows, budget * sp, self.packing, self.share_prompt)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float, ban: bool = True) -> torch.Tensor:
        """Trainer log-probs of every masked token, laid out like `batch.loss_mask`: [B, T]. `ban`: under
        a vision-language model's placeholder ban, as vLLM samples (off: as vLLM scores a prompt)."""
        if self.sp.size > 1:  # the group scores its ranks' rows together, each rank a slice of every row
            return ulysses.group_logprobs(
                lambda mb: self._forward(mb, temperature)[0], batch, self._plan, self.sp, self.device
            )

        def forward(mb):
            with self._routed(mb):
                return self._forward(mb, temperature, ban=ban)[0]

        return per_token(forward, batch, self._plan(batch), self.device)

    def adapter_disabled(self):
        """LoRA: a context in which the model is the base model (peft bypasses the adapter): the
        free KL reference."""
        return self.peft.disable_adapter()

    # --- update -------------------------------------------------------------------------------
    def _normalizer(self, batch: Batch | None) -> float:
        """Global denominator of the loss aggregation, summed over ranks (see ppo_loss)."""
        n_tok = batch.loss_mask.sum(1) if batch else torch.zeros(0)  # [B] completion tokens per row
        local = {
            "token_mean": n_tok.sum(),
            "seq_mean_token_mean": (n_tok > 0).sum(),
            # Dr.GRPO: a constant per sequence (the generation budget), not the batch's longest
            "seq_mean_token_sum_norm": len(n_tok) * completion_budget(self.cfg),
        }[self.cfg.algo.loss_agg]
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
        return (
            t.epochs * t.minibatches > 1
            or (a.kl_coef > 0 and a.kl_in == "reward")
            or (self.importance_correction and dropout)
        )

    def old_logprobs(self, batch: Batch) -> torch.Tensor:
        """pi_old, [B, T] like `batch.loss_mask`: vLLM's log-probs of the sampled tokens (algo.old_logprobs:
        rollout, or auto in float32 when pi_old only anchors the later updates' ratios: no importance
        correction, no KL in the reward) or the trainer's forward."""
        a = self.cfg.algo
        ratio_only = not self.importance_correction and not (a.kl_coef > 0 and a.kl_in == "reward")
        if a.old_logprobs == "rollout" or (
            a.old_logprobs == "auto" and self.cfg.model.dtype == "float32" and ratio_only
        ):
            return batch.logp_rollout.clone()
        return self.logprobs(batch, self.cfg.rollout.temperature)

    @property
    def importance_correction(self) -> bool:
        """TIS (a cap set) or masked IS: the loss weighs tokens by pi_old / pi_vllm."""
        return bool(self.cfg.algo.tis_cap) or self.cfg.algo.is_correction == "mask"

    def loss_knobs(self) -> dict:
        """ppo_loss's hyperparameters from algo.*: the policy loss's own (its declaration names their keys)
        and the shared ones."""
        a = self.cfg.algo
        own = {name: get(self.cfg, key) for name, key in policy_loss(a.policy_loss).knobs().items()}
        return dict(
            own,
            policy_loss=a.policy_loss,
            is_correction=a.is_correction,
            tis_cap=a.tis_cap or None,
            tis_level=a.tis_level,
            is_mask_low=a.is_mask_low,
            is_mask_high=a.is_mask_high,
            kl_type=a.kl_type,
            kl_coef=a.kl_coef if a.kl_in == "loss" else 0.0,
            entropy_coef=a.entropy_coef,
            agg=a.loss_agg,
        )

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
        # algo.distill_loss full: the teacher's head beside the policy for the step (its hidden states are the batch's)
        head_t = self.teacher.head_weight(self.device) if self.teacher is not None else None
        for m, norm, scale in minibatch_updates(
            self.engine, batch, t, self._plan, self._normalizer, self.device, grad_norms, self.platform
        ):
            sel = m.loss_mask
            seq_ids = torch.arange(len(m), device=self.device)[:, None].expand_as(sel)[sel]  # [N]
            with self._routed(m):  # MoE: held through backward, which may recompute the forward
                loss, metrics, logp, _ = self._forward(
                    m,
                    temp,
                    loss=dict(
                        logp_old=None if m.logp_old is None else m.logp_old[sel],  # None: on-policy, ratio 1
                        advantages=m.advantages[sel] if m.advantages.dim() == 2 else m.advantages[seq_ids],  # [N]
                        mask=torch.ones(len(seq_ids), device=self.device),
                        logp_ref=None if m.logp_ref is None else m.logp_ref[sel],  # logs kl_mean whenever given
                        seq_ids=seq_ids,
                        logp_rollout=m.logp_rollout[sel] if self.importance_correction else None,
                        normalizer=norm,
                        **self.loss_knobs(),
                    ),
                    distill=None
                    if head_t is None
                    else dict(hidden=m.hidden_teacher[sel], weight=head_t, beta=a.distill_beta, coef=a.distill_coef),
                )
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
                # the hand-off's alone (later minibatches' add the update's)
                diff = logp - m.logp_rollout[sel][part]  # [N]
                if m.stale is not None:  # partial rollouts: an older policy's tokens differ by its updates too
                    diff = diff[~m.stale[sel][part]]
                rollout_ratios.append(diff.clamp(-20, 20).exp())
                gap_sum, gap_n = gap_sum + float(diff.abs().sum()), gap_n + len(diff)
                gap_max = max(gap_max, float(diff.abs().max()) if len(diff) else 0.0)
            is_ratios.append(importance_ratio(old, m.logp_rollout[sel][part], seq_ids, a.tis_level))  # [N]
            if m.stale is not None and m.logp_old is None:  # the loop had no pi_old for partial.is_metrics
                stale_is.append((partial.token_weights(old, m.logp_rollout[sel][part]), m.stale[sel][part]))
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())  # micro losses sum to the minibatch's
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            sums["_w"] = sums.get("_w", 0.0) + w
        if self.sp.size > 1:  # each rank scored a slice of the group's tokens: its metrics are over all of them
            sums, (gap_sum, gap_n, gap_max), ratios, rollout_ratios, is_ratios = ulysses.merge_metrics(
                self.sp, sums, (gap_sum, gap_n, gap_max), ratios, rollout_ratios, is_ratios
            )
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
        out.update(
            distribution_metrics(
                ratio=torch.cat(ratios) if ratios else [],
                rollout_ratio=torch.cat(rollout_ratios) if rollout_ratios else [],
            )
        )
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
    def save_checkpoint(self, path: str) -> None:
        """Params, optimizer and LR schedule into `path`/ds/, as they are (after the hand-off the states
        sit offloaded; DeepSpeed's save reads them there). LoRA: the adapter and its optimizer state; the
        frozen base is model.path's."""
        self.engine.save_checkpoint(path, tag=TAG, save_latest=False, exclude_frozen_parameters=self.peft is not None)

    def load_checkpoint(self, path: str, tag: str = TAG) -> None:
        """Params, optimizer and LR schedule as DeepSpeed saved them (any ZeRO stage)."""
        load_engine_checkpoint(self.engine, path, tag, strict=self.peft is None)

    # --- hand-off and memory ------------------------------------------------------------------
    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs. ZeRO-3 gathers `bucket_bytes` of parameters at a time
        (one collective per bucket, not per parameter) and frees each bucket once the consumer
        moves past it, so a full copy of the model never exists at once. Lazy: consume it once,
        on every rank, in the same order. LoRA: the adapter's parameters only, named as in a PEFT
        adapter file (lora.sync_name); the frozen base never changes, and vLLM keeps its own. A
        vision-language model's frozen tower (model.train_vision) is left out alike."""
        named = list(self.hf.named_parameters())
        if self.peft is not None:
            named = [(lora.sync_name(n), p) for n, p in named if lora.is_adapter(n)]
        elif self.vision is not None:
            named = [(n, p) for n, p in named if not vision_frozen(n, self.vision, self.cfg.model.train_vision)]
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
