"""What the policy losses share, on flat token tensors [n]: the ratios, per-sequence sums and means,
PPO's clipped surrogate and its hyperparameters.

`tok` is kernels.ppo_loss's per-token view of a (micro-)batch: mask [n] bool, seq [n] (each token's
dense sequence index, None without seq_ids), n_seq, seq_len [n] (its sequence's unmasked token count,
>= 1). Tensor methods only, no torch import (the registry's readers stay torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algorithms.registry import reads


def seq_sum(x, tok):
    """Each token gets the sum of x over its sequence's tokens [n]. x is 0 at masked tokens; every
    sequence of the slice must be whole in it (the fused pass cuts chunks at sequence ends)."""
    if tok["seq"] is None:
        raise ValueError("this policy loss / IS level needs seq_ids")
    inv = tok["seq"]
    return x.new_zeros(tok["n_seq"]).index_add_(0, inv, x)[inv]


def seq_mean(x, tok):
    return seq_sum(x, tok) / tok["seq_len"]


def token_ratio(logp, old, tok):
    """r_t = pi / pi_old per token [n]."""
    return (logp - old).clamp(-20.0, 20.0).exp()


def seq_ratio(logp, old, tok):
    """GSPO's s_i = exp(mean over the sequence's tokens of log(pi / pi_old)), on each token [n]."""
    return seq_mean((logp - old).where(tok["mask"], 0.0), tok).clamp(-20.0, 20.0).exp()


@dataclass(frozen=True)
class Clip:
    """The clipped surrogate's range (clip-higher: DAPO, Yu et al. 2025) and the dual clip (Ye et al.
    2020, "Mastering Complex Control in MOBA Games"; None or 0 = off)."""

    eps_low: float = reads(0.2, "algo.clip_low")
    eps_high: float = reads(0.2, "algo.clip_high")
    dual_clip: float | None = reads(None, "algo.dual_clip")

    def check(self) -> None:
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1")


def clipped(ratio, adv, p: Clip):
    """PPO's pessimistic clipped term max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), min'd with
    -A * dual_clip where A < 0; where the clipped branch wins, d/dratio is exactly 0."""
    surr = (-adv * ratio).maximum(-adv * ratio.clamp(1.0 - p.eps_low, 1.0 + p.eps_high))
    if p.dual_clip:  # bound the loss of A < 0 tokens whose ratio exploded
        surr = surr.minimum(-adv * p.dual_clip).where(adv < 0, surr)
    return surr


def clip_fracs(ratio, adv, p: Clip):
    """(lower clip zeroes the gradient: r < 1 - eps_low, A < 0; upper: r > 1 + eps_high, A > 0)."""
    return (ratio < 1.0 - p.eps_low) & (adv < 0), (ratio > 1.0 + p.eps_high) & (adv > 0)
