"""GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673).

GRPO's objective is an arithmetic mean of token terms r_t A; GMPO maximises their geometric mean,
which one outlier token ratio moves far less. With d_t = log(pi_t / pi_old,t) clipped per token in
log space (wider than PPO: the paper's [-0.4, 0.4]) on the side the advantage's sign makes
pessimistic, each sequence i gets one ratio and one loss:

    s_i = exp(mean_t sgn(A) * min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high))),  L_i = -A_i s_i

A_i is the mean of the sequence's token advantages (the sample's own for grpo, dr_grpo, rloo),
as in the paper's code and verl's `geo_mean` loss. L_i is carried by each of the sequence's tokens
(as GSPO's): under seq_mean_token_mean the loss is the paper's mean over sequences. d s_i / d logp_t
= s_i / n_i where token t is inside its clip, 0 where it is clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridrl.algorithms.losses.common import seq_mean, token_ratio
from hybridrl.algorithms.registry import PolicyLoss, reads, register


@dataclass(frozen=True)
class LogClip:
    """The per-token clip of log(pi / pi_old): [-eps_low, eps_high] (the paper's 0.4 and 0.4)."""

    eps_low: float = reads(0.4, "algo.clip_low")
    eps_high: float = reads(0.4, "algo.clip_high")


def term(logp, old, adv, tok, p: LogClip):
    m = tok["mask"]
    d = (logp - old).clamp(-20.0, 20.0).where(m, 0.0)  # [n]
    sign = adv.sign()
    kept = sign * (sign * d).minimum(sign * d.clamp(-p.eps_low, p.eps_high))  # the pessimistic side clipped
    s = seq_mean(kept, tok).exp()  # [n]: s_i on each token
    return -seq_mean(adv.where(m, 0.0), tok) * s


def clip_fracs(ratio, adv, p: LogClip):
    """The tokens whose log-ratio the clip stops: below -eps_low with A < 0, above eps_high with A > 0."""
    return (ratio < math.exp(-p.eps_low)) & (adv < 0), (ratio > math.exp(p.eps_high)) & (adv > 0)


SPEC = register(
    PolicyLoss(
        "gmpo",
        "geometric mean of the token ratios, each clipped in log space; default clip 0.4 / 0.4, the paper's",
        term,
        ratio=token_ratio,
        clip_fracs=clip_fracs,
        params=LogClip,
        sequence=True,
        clip=(0.4, 0.4),
    )
)
