"""Liger-Kernel's fused linear GRPO loss behind our loss convention (`train.kernels=liger`).

Liger (TRL's choice) fuses the LM head with the clipped surrogate but reduces each call with its
own normaliser. We rescale its result so that it equals `ppo_loss` with an explicit global
`normalizer`: micro-batch losses then sum to the full-batch loss, as with our own kernels.
Departures: no dual clip, truncated IS, KL or entropy bonus here (use `torch`/`triton`), and it
computes logits for every position of the rows it is given, not only completion tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# our aggregation -> Liger's loss_type
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def liger_ppo_loss(hidden, weight, targets, mask, advantages, logp_old=None, temperature=1.0, bias=None, *,
                   eps_low=0.2, eps_high=0.2, agg="token_mean", normalizer, max_len=None):
    """hidden [B, T, d], targets/mask/logp_old [B, T], advantages [B] -> (loss, metrics).

    loss == ppo_loss(logp, logp_old, A, mask, agg=agg, normalizer=normalizer) over these rows.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_type = LOSS_TYPES[agg]
    fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, epsilon_low=eps_low,
                                  epsilon_high=eps_high, loss_type=loss_type, max_completion_length=max_len,
                                  temperature=temperature)
    B = hidden.shape[0]
    if loss_type == "dapo":  # Liger divides by normalizer / world size (TRL's DDP convention)
        kw, scale = {"num_items_in_batch": normalizer}, 1.0 / _world()
    elif loss_type == "grpo":  # Liger: sum of per-sequence means / B (rows in this call)
        kw, scale = {}, B / normalizer
    else:  # dr_grpo: sum / (B * max_len)
        kw, scale = {}, B * max_len / normalizer
    loss, metrics = fn(hidden, weight, targets, mask.float(), advantages, bias=bias,
                       old_per_token_logps=logp_old, **kw)
    return loss * scale, {"clip_frac": metrics[-1].detach()}
