"""GSPO and GSPO-token (Zheng et al. 2025, arXiv 2507.18071): a sequence-level ratio, clipped.

Their clip range is the paper's, 3e-4 / 4e-4 (verl's GSPO recipe too), where the user sets neither
algo.clip_low nor algo.clip_high: a length-normalised sequence ratio stays within ~1e-3 of 1 where
PPO's token ratios move by tenths, and on the demo PPO's range, which a sequence ratio never reaches,
left GSPO learning less (docs/losses.md, "Demo runs").
"""

from __future__ import annotations

from hybridrl.algorithms.losses.common import Clip, clip_fracs, clipped, seq_ratio
from hybridrl.algorithms.registry import Liger, PolicyLoss, register

CLIP = (3e-4, 4e-4)


def gspo(logp, old, adv, tok, p: Clip):
    """L_i = max(-A s_i, -A clip(s_i, 1 - eps_low, 1 + eps_high)) on each of sequence i's tokens.
    d s_i / d logp_t = s_i / n_i: every token of a sequence gets the same gradient, and a clipped
    sequence none. Departure: a per-token advantage (reinforce_pp, gae) is used as it is, each token
    then carrying max(-A_t s_i, -A_t clip(s_i))."""
    return clipped(seq_ratio(logp, old, tok), adv, p)


def gspo_token(logp, old, adv, tok, p: Clip):
    """s_i,t = sg[s_i] * pi_t / sg[pi_t] has the value s_i and the gradient s_i * d logp_t; clipped
    per token like PPO. With one advantage per sequence its gradient equals GSPO's under
    seq_mean_token_mean; it differs with per-token advantages."""
    s = seq_ratio(logp.detach(), old, tok) * (logp - logp.detach()).exp()  # value s_i, grad s_i
    return clipped(s, adv, p)


GSPO = register(
    PolicyLoss(
        "gspo",
        "sequence ratio exp(mean log-ratio), sequence clipping; default clip 3e-4 / 4e-4, the paper's",
        gspo,
        ratio=seq_ratio,
        clip_fracs=clip_fracs,
        params=Clip,
        sequence=True,
        clip=CLIP,
        liger=Liger("sequence"),
    )
)
GSPO_TOKEN = register(
    PolicyLoss(
        "gspo_token",
        "GSPO's token variant, the same clip range",
        gspo_token,
        ratio=seq_ratio,
        clip_fracs=clip_fracs,
        params=Clip,
        sequence=True,
        clip=CLIP,
    )
)
