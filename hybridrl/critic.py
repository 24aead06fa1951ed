"""The critic of PPO with GAE (`algo.advantage=gae`): the policy's base model plus a scalar value
head, as a second DeepSpeed ZeRO-2/3 engine on the same device as the policy's.

Verbs, like the trainer's: `values(batch)` (the loop's `values` phase, before the update: the old
values that GAE and value clipping use), `step(batch)` (the `critic` phase: epochs x minibatches
updates on the clipped value loss, `algo.critic_lr`), `save_checkpoint` / `load_checkpoint`.
On GPU its parameters and optimizer states leave the device after each update and come back for
the next `values` call (DeepSpeed's offload_states / reload_states, as the policy's), so it holds
no device memory while vLLM generates; on CPU that is a no-op.

V(s_t) for completion token t is read from the hidden state that predicts token t (position t-1),
so values line up with the policy's log-probs ([B, T], like Batch.loss_mask). It starts from the
policy's weights (or `algo.critic_path`) with a zero value head: V = 0 before the first update.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import deepspeed
import torch
from torch import nn

from . import algo, zero_step
from .batch import Batch, per_token
from .config import Config, UserError
from .launch import all_sum, world_size
from .trainer import (ds_config, from_pretrained, load_engine_checkpoint, lr_scheduler, minibatch_updates,
                      offload_engine_states, plan_micro_batches, reload_engine_states)

TAG = "critic"  # its DeepSpeed checkpoint's directory inside a hybridrl checkpoint


class _ValueModel(nn.Module):
    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.head = nn.Linear(base.config.hidden_size, 1, dtype=base.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens, attention_mask, loss_mask) -> torch.Tensor:
        """Values of the masked tokens' states: [N] float32."""
        hidden = self.base(input_ids=tokens, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1][loss_mask[:, 1:]]).squeeze(-1).float()  # [N]


class Critic:
    def __init__(self, cfg: Config, model_path: str, *, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str):
        from transformers import AutoModel

        self.cfg, self.device = cfg, device
        own = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=cfg.algo.critic_lr))
        conf = ds_config(own, dtype == torch.bfloat16)
        base = from_pretrained(AutoModel, cfg.algo.critic_path or model_path, conf, dtype=dtype,
                               attn_implementation=attn_implementation, trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.gradient_checkpointing:
            base.gradient_checkpointing_enable()
        model = _ValueModel(base)  # under ZeRO-3 the new head is partitioned by deepspeed.initialize
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf,
                                               lr_scheduler=lr_scheduler(own))
        zero_step.install(self.engine.optimizer, world_size())
        self.offload()

    def _plan(self, rows: Batch | None) -> list[torch.Tensor | None]:
        return plan_micro_batches(rows, self.cfg.train.max_tokens_per_micro_batch)  # padded rows

    def _forward(self, mb: Batch) -> torch.Tensor:
        return self.engine(mb.tokens, mb.attention_mask(), mb.loss_mask)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of every completion token before this step's update: [B, T]."""
        self.reload()
        return per_token(self._forward, batch, self._plan(batch), self.device)

    def step(self, batch: Batch) -> dict[str, float]:
        """epochs x minibatches updates on the clipped value loss against batch.returns, from the
        old values batch.values; then the states leave the device. Returns mean metrics."""
        sums, grad_norms = {}, []
        for m, norm, scale in minibatch_updates(self.engine, batch, self.cfg.train, self._plan, _token_count,
                                                self.device, grad_norms):
            sel = m.loss_mask
            loss, metrics = algo.value_loss(self._forward(m), m.values[sel], m.returns[sel],
                                            clip=self.cfg.algo.value_clip, normalizer=norm)
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            if not scale:  # a dummy micro-batch
                continue
            w = float(sel.sum())
            sums["value_loss"] = sums.get("value_loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            sums["_w"] = sums.get("_w", 0.0) + w
        n_updates = len(grad_norms)
        sums["critic_grad_norm"] = sum(grad_norms)
        self.offload()
        w = max(sums.pop("_w", 0.0), 1.0)
        per_update = ("value_loss", "critic_grad_norm")
        out = {k: v / w for k, v in sums.items() if k not in per_update}
        out.update({k: sums.get(k, 0.0) / max(n_updates, 1) for k in per_update})
        return out

    # --- checkpoints: a DeepSpeed checkpoint of its own, `critic/` beside the policy's `ds/` -------
    def save_checkpoint(self, path: str) -> None:
        """Saved where the states are: the loop saves after the hand-off, when they sit offloaded in
        host memory and vLLM's KV cache is awake. DeepSpeed's save reads them there (ZeRO-2's
        state_dict and ZeRO-3's _rigid_state_dict take the master weights and Adam moments as
        tensors wherever they live, and the parameters through the module's state_dict); reloading
        first would bring the critic back onto the device beside vLLM, memory the plan never had."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # a non-blocking offload's copies into host memory have landed
        self.engine.save_checkpoint(path, tag=TAG, save_latest=False)

    def load_checkpoint(self, path: str) -> None:
        if not (Path(path) / TAG).is_dir():
            raise UserError(f"{path} holds no critic (it was saved without algo.advantage=gae); resume it with "
                            "the run's own algo.advantage, or start a new run")
        self.reload()
        load_engine_checkpoint(self.engine, path, TAG)
        self.offload()

    # --- memory ------------------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters and optimizer states to CPU between its phases (GPU only)."""
        if self.device.type == "cuda":
            offload_engine_states(self.engine)  # all of it: the critic takes no part in the hand-off

    def reload(self) -> None:
        if self.device.type == "cuda":
            reload_engine_states(self.engine)


def _token_count(mini: Batch | None) -> float:
    """The value loss's normaliser: the minibatch's completion tokens over all ranks."""
    return max(all_sum([float(mini.loss_mask.sum()) if mini else 0.0])[0], 1.0)
