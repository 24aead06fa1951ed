"""CISPO (MiniMax-M1, arXiv 2506.13585): the clipped IS weight as a stop-gradient coefficient on log pi."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algorithms.losses.common import token_ratio
from hybridrl.algorithms.registry import Liger, PolicyLoss, reads, register


@dataclass(frozen=True)
class CISPOParams:
    """The weight is clipped to [1 - low, 1 + high]; defaults 1 and 4: no lower bound (MiniMax-M1), the
    upper bound 5 that Liger-Kernel's documentation suggests."""

    cispo_clip_low: float = reads(1.0, "algo.cispo_clip_low")
    cispo_clip_high: float = reads(4.0, "algo.cispo_clip_high")

    def check(self) -> None:
        if self.cispo_clip_low < 0 or self.cispo_clip_high < 0:
            raise ValueError("cispo_clip_low and cispo_clip_high must be >= 0")


def term(logp, old, adv, tok, p: CISPOParams):
    """L_t = -sg[clip(r_t, 1 - low, 1 + high)] * A * log pi_t. No token's gradient is zeroed: the clip
    bounds its weight, not its presence (the paper's motivation: PPO's clip drops the rare tokens that
    open reflective branches)."""
    w = token_ratio(logp, old, tok).detach().clamp(1.0 - p.cispo_clip_low, 1.0 + p.cispo_clip_high)
    return -w * adv * logp


def clip_fracs(ratio, adv, p: CISPOParams):
    """The tokens whose weight its lower / upper bound truncates, whatever the sign of A."""
    return ratio < 1.0 - p.cispo_clip_low, ratio > 1.0 + p.cispo_clip_high


def _liger_needs(algo) -> str:
    if algo.loss_agg != "token_mean" or algo.cispo_clip_low < 1:
        return (
            "train.kernels=liger's cispo has no lower bound and reduces by token mean: use algo.loss_agg "
            "token_mean and algo.cispo_clip_low 1, or train.kernels=auto"
        )
    return ""


SPEC = register(
    PolicyLoss(
        "cispo",
        "clipped IS weight as a stop-gradient coefficient on log pi (bounds: algo.cispo_clip_low/high)",
        term,
        ratio=token_ratio,
        clip_fracs=clip_fracs,
        params=CISPOParams,
        # Liger's cispo bounds the ratio itself, above only, and reduces by token mean
        liger=Liger(
            "token", eps=lambda p: (p.cispo_clip_low, 1.0 + p.cispo_clip_high), loss_type="cispo", needs=_liger_needs
        ),
    )
)
