"""Liger-Kernel's fused linear GRPO loss behind our loss convention (`train.kernels=liger`).

Liger (TRL's choice) fuses the LM head with the policy loss but reduces each call with its own
normaliser. We rescale its result so that it equals `ppo_loss` with an explicit global
`normalizer`: micro-batch losses then sum to the full-batch loss, as with our own kernels.
A policy loss's declaration says how it maps onto Liger's (its `liger`: hybridrl/algorithms/): ppo ->
its clipped surrogate; gspo -> its importance_sampling_level="sequence" (each token carries its
sequence's clipped loss, as ours); cispo -> its loss_type="cispo" (an upper bound only, reduced by
token mean); the others have no equivalent. The IS weight (TIS or masked IS, computed by
`kernels.ppo_loss.importance_weights`) goes in as its `vllm_is_ratio`. Departures: no dual clip, KL
or entropy bonus here (use `torch`/`triton`), and it computes logits for every position of the rows
it is given, not only completion tokens.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridrl.algorithms.registry import loss_params, policy_loss as declared

# our aggregation -> Liger's loss_type
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def liger_ppo_loss(
    hidden,
    weight,
    targets,
    mask,
    advantages,
    logp_old=None,
    temperature=1.0,
    bias=None,
    *,
    policy_loss="ppo",
    is_weights=None,
    agg="token_mean",
    normalizer,
    max_len=None,
    **params,
):
    """hidden [B, T, d], targets/mask/logp_old/is_weights [B, T], advantages [B] -> (loss, metrics).

    loss == ppo_loss(logp, logp_old, A, mask, policy_loss=..., agg=agg, normalizer=normalizer, **params)
    over these rows, with is_weights as the IS weight; `params`: the policy loss's own hyperparameters.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    spec = declared(policy_loss)
    if spec.liger is None:
        raise ValueError(f"train.kernels=liger has no policy_loss={policy_loss!r}; use train.kernels=auto")
    loss_type = spec.liger.loss_type or LOSS_TYPES[agg]
    if spec.liger.loss_type and agg != "token_mean":
        raise ValueError(f"Liger's {loss_type} reduces by token mean only: use agg token_mean")
    eps_low, eps_high = spec.liger.eps(loss_params(spec, params))
    fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        compiled=False,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        loss_type=loss_type,
        max_completion_length=max_len,
        temperature=temperature,
        importance_sampling_level=spec.liger.level,
    )
    B = hidden.shape[0]
    if loss_type in ("dapo", "cispo"):  # Liger divides by normalizer / world size (TRL's DDP convention)
        kw, scale = {"num_items_in_batch": normalizer}, 1.0 / _world()
    elif loss_type == "grpo":  # Liger: sum of per-sequence means / B (rows in this call)
        kw, scale = {}, B / normalizer
    else:  # dr_grpo: sum / (B * max_len)
        kw, scale = {}, B * max_len / normalizer
    loss, metrics = fn(
        hidden,
        weight,
        targets,
        mask.float(),
        advantages,
        bias=bias,
        old_per_token_logps=logp_old,
        vllm_is_ratio=is_weights,
        **kw,
    )
    return loss * scale, {"clip_frac": metrics[-1].detach()}
