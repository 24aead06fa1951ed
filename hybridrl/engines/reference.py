"""The reference policy of the KL penalty: a frozen copy of the initial policy (or `algo.ref_path`).

Verb: `logprobs(batch, temperature)`, the loop's `ref_logprob` phase. It is colocated with the
trainer on every rank and holds no device memory while idle. Under ZeRO-3 it is sharded like the
policy: loaded partitioned (zero_engine.from_pretrained), run as a DeepSpeed ZeRO-3 engine without an
optimizer that gathers one layer at a time during the phase, its shard kept in pinned host memory
on a GPU (`offload_param`, as OpenRLHF's reference does): one copy of the weights per node, not
per rank. Under ZeRO-2 (whose policy is replicated anyway) it is a plain module, its weights in
pinned CPU memory, copied to the device (non-blocking) for the phase and dropped after it; nothing
is copied back, since they never change. On CPU those moves are no-ops. `Reference.load` returns
None when algo.kl_coef == 0: no reference model is loaded at all. With LoRA (model.lora_rank > 0)
the reference is the base model, which the trainer already holds: `BaseModelReference` runs the
trainer's own model with the adapter disabled, so nothing is loaded either (unless algo.ref_path
names another model). With sequence parallelism (train.sequence_parallel_size > 1) it scores like the
trainer: the group's rows together, each rank a slice of every packed micro-batch (ulysses.py), so no
rank runs more than train.max_tokens_per_micro_batch tokens of a long sequence.
"""

from __future__ import annotations

from itertools import chain

import deepspeed
import torch

from hybridrl.core.config import Config
from hybridrl.core.models import load_class
from hybridrl.data.batch import Batch, micro_batches, per_token, shared_micro_batches
from hybridrl.engines import deepspeed_compat, ulysses
from hybridrl.engines.policy import TokenLogprobs, module_inputs, share_prompt
from hybridrl.engines.zero_engine import ZERO3_SHARED, from_pretrained, plan_micro_batches, precision


def ds_config(cfg: Config, bf16: bool, cuda: bool) -> dict:
    """The reference's DeepSpeed config: parameters only (no optimizer), the policy's ZeRO stage;
    under ZeRO-3 on a GPU the shards live in pinned host memory between forwards."""
    zero = {"stage": cfg.train.zero_stage, **ZERO3_SHARED}
    if cuda and cfg.train.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class Reference:
    @staticmethod
    def load(
        cfg: Config,
        model_path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        attn_implementation: str,
        trainer=None,
    ) -> "Reference | BaseModelReference | None":
        """The reference model, or None when algo.kl_coef == 0 (nothing is loaded); with LoRA the
        trainer's base model (`trainer`, adapter disabled: nothing is loaded)."""
        if cfg.algo.kl_coef == 0:
            return None
        if cfg.model.lora_rank and not cfg.algo.ref_path and trainer is not None:
            return BaseModelReference(trainer)
        return Reference(
            cfg,
            cfg.algo.ref_path or model_path,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            sp=trainer.sp if trainer is not None else None,
        )

    def __init__(
        self,
        cfg: Config,
        path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        attn_implementation: str,
        sp: ulysses.Group | None = None,
    ):
        """`sp`: the trainer's sequence-parallel group (None or a group of one: none)."""
        self.cfg, self.device = cfg, device
        self.sp = sp if sp is not None and sp.size > 1 else None
        cuda = device.type == "cuda"
        dtype, autocast = precision(cfg, dtype)  # the policy's numerics: at step 1 its log-probs to the bit
        conf = ds_config(cfg, dtype == torch.bfloat16, cuda)
        hf = from_pretrained(
            load_class(path, cfg.model.trust_remote_code),
            path,
            conf,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        hf.eval().requires_grad_(False)
        kernels = cfg.train.kernels
        # as the trainer picks (train.kernels auto = chunked torch): at step 1 the reference's log-probs
        # are the policy's to the bit, so the KL starts at 0
        provider = {"auto": "torch", "liger": "torch"}.get(kernels, kernels)
        self.module = TokenLogprobs(hf, provider, cfg.train.logprob_chunk, autocast=autocast)
        if self.sp is not None:  # the trainer checked that the model can read packed rows
            ulysses.install(hf)
            self.module.sp = self.sp
        self.sharded = cfg.train.zero_stage == 3
        # the policy's shared-prompt layout (and so, at step 1, exactly the policy's log-probs)
        self.share = share_prompt(
            cfg, hf, "liger" if kernels == "liger" else provider, attn_implementation, packing=False
        )
        self._host = []
        if self.sharded:  # the head's weight is used by this module's forward, not by lm_head's
            deepspeed.zero.register_external_parameter(self.module, hf.get_output_embeddings().weight)
            deepspeed_compat.moe_leaf_modules(hf)  # as the trainer: ranks routing differently gather alike
            self.module, *_ = deepspeed.initialize(model=self.module, config=conf)
            self.module.eval()
        else:  # (tensor, its CPU master copy): the device copy is made from the master for each phase
            self._host = [
                (t, t.data.pin_memory() if cuda else t.data)
                for t in chain(self.module.parameters(), self.module.buffers())
            ]

    def _place(self, device: torch.device) -> None:
        for t, host in self._host:
            t.data = host if device.type == "cpu" else host.to(device, non_blocking=True)

    keep_hidden = False  # a teacher of algo.distill_loss full: its final hidden states too

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float):
        """Reference log-probs of every completion token at the sampling temperature: [B, T]; with
        `keep_hidden`, and the final hidden states that predict them: ([B, T], [B, T, d])."""
        budget = self.cfg.train.max_tokens_per_micro_batch
        if self.sp is not None:  # the group's rows in packed micro-batches of its ranks' budgets, each rank a slice

            def plan(rows):  # the trainer's: a longer sequence gets a micro-batch of its own, the update refuses it
                return plan_micro_batches(rows, budget * self.sp.size, packed=True)

            def forward_slice(mb):
                _, args, kw = ulysses.module_inputs(mb, self.sp)
                return self.module(*args, temperature, **kw)[0]

            self._place(self.device)
            try:
                return ulysses.group_logprobs(forward_slice, batch, plan, self.sp, self.device)
            finally:
                self._place(torch.device("cpu"))
        # sharded: every rank runs as many forwards as the busiest (each gathers collectively)
        if self.sharded:
            groups = plan_micro_batches(batch, budget, shared=self.share)
        else:
            groups = shared_micro_batches(batch, budget) if self.share else micro_batches(batch.lengths, budget)

        def forward(mb):
            args, kw = module_inputs(mb, False, self.share)
            out = self.module(*args, temperature, keep_hidden=self.keep_hidden, **kw)
            return (out[0], out[2]) if self.keep_hidden else out[0]

        self._place(self.device)
        try:
            return per_token(forward, batch, groups, self.device)
        finally:
            self._place(torch.device("cpu"))

    def head_weight(self, device: torch.device) -> torch.Tensor:
        """The LM head's whole weight on `device`, gathered under ZeRO-3: the teacher's logits in the
        train phase (algo.distill_loss full), where its hidden states come from the batch."""
        w = (self.module.module if self.sharded else self.module).hf.get_output_embeddings().weight
        if self.sharded:
            with deepspeed.zero.GatheredParameters([w]):
                return w.data.to(device, copy=True)
        return w.data.to(device)


def load_teacher(
    cfg: Config, *, device: torch.device, dtype: torch.dtype, attn_implementation: str, trainer=None
) -> Reference | None:
    """algo.teacher's model, or None: scored as the reference is (colocated, sharded under ZeRO-3 with its
    shards in pinned host memory, copied to the device for its phase under ZeRO-2), in the policy's
    numerics; frozen, so a checkpoint holds nothing of it and a resume loads it again. With
    algo.distill_loss full it keeps its hidden states (Batch.hidden_teacher) and the trainer its head."""
    if not cfg.algo.teacher:
        return None
    teacher = Reference(
        cfg,
        cfg.algo.teacher,
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        sp=trainer.sp if trainer is not None else None,
    )
    if cfg.algo.distill_loss == "full":
        teacher.keep_hidden = True
        if trainer is not None:
            trainer.teacher = teacher
    return teacher


class BaseModelReference:
    """LoRA's reference policy for free: the trainer's model with its adapter disabled is the base
    model, i.e. the initial policy (B = 0 at the start). It holds no parameters of its own; under
    ZeRO-3 it gathers the trainer's shards like any trainer forward."""

    def __init__(self, trainer):
        self.trainer = trainer

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """Base-model log-probs of every completion token at the sampling temperature: [B, T]."""
        with self.trainer.adapter_disabled():
            return self.trainer.logprobs(batch, temperature)
