"""PPO's clipped surrogate (Schulman et al. 2017), with clip-higher and the dual clip (common.Clip)."""

from __future__ import annotations

from hybridrl.algorithms.losses.common import Clip, clip_fracs, clipped, token_ratio
from hybridrl.algorithms.registry import Liger, PolicyLoss, register


def term(logp, old, adv, tok, p: Clip):
    """L_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), r_t = pi / pi_old."""
    return clipped(token_ratio(logp, old, tok), adv, p)


SPEC = register(
    PolicyLoss(
        "ppo", "clipped token ratio", term, ratio=token_ratio, clip_fracs=clip_fracs, params=Clip, liger=Liger("token")
    )
)
