"""The reference policy of the KL penalty: a frozen copy of the initial policy (or `algo.ref_path`).

Verb: `logprobs(batch, temperature)`, the loop's `ref_logprob` phase. It is colocated with the
trainer on every rank but kept off the device while idle: its weights live in pinned CPU memory,
are copied to the device (non-blocking) for the phase and dropped after it; nothing is copied
back, since they never change. On CPU that is a no-op. Its peak on the device is one copy of the
weights plus one micro-batch's activations, while vLLM sleeps.

A plain module, not a DeepSpeed engine: it has no gradients or optimizer states for ZeRO to
shard, and without ZeRO-3's collective gathers ranks may run different micro-batch counts.
Departure (not built): under ZeRO-3 every rank still holds a full copy of the reference weights
during the phase. `Reference.load` returns None when algo.kl_coef == 0: no reference model is
loaded at all.
"""

from __future__ import annotations

from itertools import chain

import torch

from .batch import Batch, micro_batches, per_token
from .config import Config
from .trainer import _TokenLogprobs


class Reference:
    @staticmethod
    def load(cfg: Config, model_path: str, *, device: torch.device, dtype: torch.dtype,
             attn_implementation: str) -> "Reference | None":
        """The reference model, or None when algo.kl_coef == 0 (nothing is loaded)."""
        if cfg.algo.kl_coef == 0:
            return None
        return Reference(cfg, cfg.algo.ref_path or model_path, device=device, dtype=dtype,
                         attn_implementation=attn_implementation)

    def __init__(self, cfg: Config, path: str, *, device: torch.device, dtype: torch.dtype,
                 attn_implementation: str):
        from transformers import AutoModelForCausalLM

        self.cfg, self.device = cfg, device
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                  trust_remote_code=cfg.model.trust_remote_code)
        hf.eval().requires_grad_(False)
        kernels = cfg.train.kernels
        provider = {"auto": "triton" if device.type == "cuda" else "torch", "liger": "torch"}.get(kernels, kernels)
        self.module = _TokenLogprobs(hf, provider, cfg.train.logprob_chunk)
        cuda = device.type == "cuda"
        # (tensor, its CPU master copy): the device copy is made from the master for each phase
        self._host = [(t, t.data.pin_memory() if cuda else t.data)
                      for t in chain(self.module.parameters(), self.module.buffers())]

    def _place(self, device: torch.device) -> None:
        for t, host in self._host:
            t.data = host if device.type == "cpu" else host.to(device, non_blocking=True)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """Reference log-probs of every completion token at the sampling temperature: [B, T]."""
        self._place(self.device)
        try:
            groups = micro_batches(batch.lengths, self.cfg.train.max_tokens_per_micro_batch)
            return per_token(lambda mb: self.module(mb.tokens, mb.attention_mask(), mb.loss_mask, temperature)[0],
                             batch, groups, self.device)
        finally:
            self._place(torch.device("cpu"))
