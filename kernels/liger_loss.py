"""Liger-Kernel's fused linear GRPO loss behind our loss convention (`train.kernels=liger`).

Liger (TRL's choice) fuses the LM head with the policy loss but reduces each call with its own
normaliser. We rescale its result so that it equals `ppo_loss` with an explicit global
`normalizer`: micro-batch losses then sum to the full-batch loss, as with our own kernels.
Our policy losses map onto Liger's: ppo -> its clipped surrogate; gspo -> its
importance_sampling_level="sequence" (each token carries its sequence's clipped loss, as ours);
cispo -> its loss_type="cispo" (an upper bound only, reduced by token mean). The IS weight (TIS or
masked IS, computed by `kernels.ppo_loss.importance_weights`) goes in as its `vllm_is_ratio`.
Departures: no gspo_token, dual clip, KL or entropy bonus here (use `torch`/`triton`), and it
computes logits for every position of the rows it is given, not only completion tokens.
"""

from __future__ import annotations

import torch.distributed as dist

# our aggregation -> Liger's loss_type
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
IS_LEVELS = {"ppo": "token", "gspo": "sequence", "cispo": "token"}  # our policy loss -> Liger's level


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def liger_ppo_loss(hidden, weight, targets, mask, advantages, logp_old=None, temperature=1.0, bias=None, *,
                   policy_loss="ppo", eps_low=0.2, eps_high=0.2, cispo_clip_high=4.0, is_weights=None,
                   agg="token_mean", normalizer, max_len=None):
    """hidden [B, T, d], targets/mask/logp_old/is_weights [B, T], advantages [B] -> (loss, metrics).

    loss == ppo_loss(logp, logp_old, A, mask, policy_loss=..., agg=agg, normalizer=normalizer) over
    these rows, with is_weights as the IS weight.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    if policy_loss not in IS_LEVELS:
        raise ValueError(f"train.kernels=liger has no policy_loss={policy_loss!r}; use train.kernels=auto")
    loss_type = LOSS_TYPES[agg]
    if policy_loss == "cispo":
        if agg != "token_mean":
            raise ValueError("Liger's cispo reduces by token mean only: use agg token_mean")
        loss_type, eps_high = "cispo", 1.0 + cispo_clip_high  # Liger's cispo bound is the ratio itself
    fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, epsilon_low=eps_low,
                                  epsilon_high=eps_high, loss_type=loss_type, max_completion_length=max_len,
                                  temperature=temperature, importance_sampling_level=IS_LEVELS[policy_loss])
    B = hidden.shape[0]
    if loss_type in ("dapo", "cispo"):  # Liger divides by normalizer / world size (TRL's DDP convention)
        kw, scale = {"num_items_in_batch": normalizer}, 1.0 / _world()
    elif loss_type == "grpo":  # Liger: sum of per-sequence means / B (rows in this call)
        kw, scale = {}, B / normalizer
    else:  # dr_grpo: sum / (B * max_len)
        kw, scale = {}, B * max_len / normalizer
    loss, metrics = fn(hidden, weight, targets, mask.float(), advantages, bias=bias,
                       old_per_token_logps=logp_old, vllm_is_ratio=is_weights, **kw)
    return loss * scale, {"clip_frac": metrics[-1].detach()}
