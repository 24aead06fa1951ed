"""Advantage estimators as pure functions, each declared once (algorithms/registry.py).

Two kinds:
- one advantage per sample, from its group of n ([P, n] rewards): grpo, dr_grpo, rloo;
- one per completion token ([B, T], laid out like `Batch.loss_mask`, rows in group order, the
  sample's reward on its last completion token): reinforce_pp, gae (which reads a critic's values).

Each takes an `Experience` and gives (advantages, returns); `advantages.estimate` builds the
Experience from a rollout batch. Definitions and derivations: docs/losses.md.

KL in the reward (`algo.kl_in=reward`), as in OpenRLHF: each completion token gets the reward
-beta * KL_t (`Experience.kl`). The token-level estimators use it as it is. Departure from OpenRLHF
for the group estimators: OpenRLHF adds the per-token penalty after the group baseline (so a token's
advantage is (R - mean) - beta * sum_{s>=t} KL_s); here beta * sum_t KL_t is taken off the sample's
reward BEFORE the group baseline, so that those estimators stay one-number-per-sample and the
baseline (and GRPO's std) see the penalised reward.

Tensor methods only, no torch import: the config reads the declarations before torch is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hybridrl.algorithms.registry import Estimator, register

if TYPE_CHECKING:
    from torch import Tensor

EPS = 1e-6


# --- one advantage per sample, from its group: [P, n] -> [P, n] --------------------------------
def grpo(rewards: Tensor) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (R - group mean) / (group std + eps).

    The std is torch's default unbiased estimator, as in TRL and verl, so numbers match theirs.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else mean.new_zeros(mean.shape)
    return (rewards - mean) / (std + EPS)  # [P, n]


def dr_grpo(rewards: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): R - group mean; no std division (it favours easy/hard groups)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): R_i - mean of the other n-1 samples of the group."""
    n = rewards.shape[1]
    if n < 2:
        return rewards.new_zeros(rewards.shape)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * n / (n - 1)


# --- the token-level pieces ----------------------------------------------------------------------
def _no_reduce(values: list[float]) -> list[float]:
    return values


@dataclass
class Experience:
    """What an estimator may read. Token tensors are [B, T] like Batch.loss_mask, B = P * n."""

    rewards: Tensor  # [P, n] the task's rewards
    mask: Tensor  # [B, T] bool, completion tokens
    kl: Tensor | None = None  # [B, T] beta * KL_t when the KL is in the reward, else None
    values: Tensor | None = None  # [B, T] the critic's values before this update (gae)
    gamma: float = 1.0
    lam: float = 1.0
    all_sum: Callable[[list[float]], list[float]] = _no_reduce  # sums over every rank (launch.all_sum)


def token_rewards(seq_rewards: Tensor, mask: Tensor, kl: Tensor | None) -> Tensor:
    """The sample's reward on its last completion token, minus the KL penalty on every token: [B, T]."""
    last = mask & (mask.cumsum(1) == mask.sum(1, keepdim=True))  # [B, T] one True per non-empty row
    r = seq_rewards[:, None].float().where(last, 0.0)
    return r if kl is None else r - kl


def discounted_returns(r: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} along each row's completion, 0 elsewhere: [B, T]. t + 1 is the
    next masked token: a multi-turn episode's environment tokens are skipped, not steps."""
    out, g = r.new_zeros(r.shape), r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        g = (r[:, t] + gamma * g).where(mask[:, t], g)  # carried across unmasked tokens
        out[:, t] = g.where(mask[:, t], 0.0)
    return out


def whiten(x: Tensor, mask: Tensor, all_sum: Callable[[list[float]], list[float]] = _no_reduce) -> Tensor:
    """(x - mean) / (std + eps) over the completion tokens of the WHOLE global batch (every rank's
    rows: two all-reduces), population std as in OpenRLHF; 0 off the mask. [B, T]."""
    m = mask.double()
    x64 = x.double()
    total, n = all_sum([float((x64 * m).sum()), float(m.sum())])
    mean = total / max(n, 1.0)
    (sq,) = all_sum([float((((x64 - mean) * m) ** 2).sum())])
    std = math.sqrt(sq / max(n, 1.0))
    return ((x64 - mean) / (std + EPS)).to(x.dtype).where(mask, 0.0)


# --- the estimators: Experience -> (advantages [B] or [B, T], returns [B, T] or None) ------------
def _per_sample(fn):
    def estimate(x: Experience):
        R = x.rewards if x.kl is None else x.rewards - x.kl.sum(1).view_as(x.rewards)  # see the module docstring
        return fn(R).flatten(), None  # [B]

    estimate.__doc__ = f"{fn.__name__} on R - beta * sum_t KL_t (when the KL is in the reward): [B]."
    return estimate


def reinforce_pp(x: Experience) -> tuple[Tensor, None]:
    """REINFORCE++ with baseline (Hu et al. 2025, "REINFORCE++"; OpenRLHF's reinforce_baseline):
    token reward = (R - group mean) on the last token, - beta * KL_t on each; discounted returns;
    then whitened over every completion token of the global batch (all ranks). [B, T]

    Note: whitening shifts a group whose rewards are all equal away from 0 (by -mean / std), so
    algo.skip_zero_advantage rarely skips a sample here, as in OpenRLHF.
    """
    base = (x.rewards - x.rewards.mean(dim=1, keepdim=True)).flatten()  # [B]
    returns = discounted_returns(token_rewards(base, x.mask, x.kl), x.mask, x.gamma)  # [B, T]
    return whiten(returns, x.mask, x.all_sum), None


def gae(x: Experience) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) for PPO with a critic.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0); A_t = delta_t + gamma *
    lambda * A_{t+1}; returns R_t = A_t + V_t (the critic's target). r_t is the sample's reward on
    its last token minus the KL penalty. t + 1 is the next masked token (a multi-turn episode's
    environment tokens are not steps: verl's multi-turn GAE does the same). The advantages are then
    whitened over the global batch (OpenRLHF and verl do the same); the returns are not. ([B, T], [B, T])
    """
    r = token_rewards(x.rewards.flatten(), x.mask, x.kl)  # [B, T]
    v = x.values.float().where(x.mask, 0.0)  # [B, T]
    adv, last, nxt = v.new_zeros(v.shape), v.new_zeros(v.shape[0]), v.new_zeros(v.shape[0])
    for t in reversed(range(v.shape[1])):  # nxt, last: of the next masked token (0 after a row's last)
        m = x.mask[:, t]
        a = r[:, t] + x.gamma * nxt - v[:, t] + x.gamma * x.lam * last
        last, nxt = a.where(m, last), v[:, t].where(m, nxt)  # environment tokens are skipped
        adv[:, t] = a.where(m, 0.0)
    return whiten(adv, x.mask, x.all_sum), adv + v


GROUP_ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}  # name -> fn([P, n]) -> [P, n]
register(Estimator("grpo", "(R - group mean) / group std, one per sample", _per_sample(grpo)))
register(Estimator("dr_grpo", "R - group mean (Dr. GRPO), one per sample", _per_sample(dr_grpo)))
register(Estimator("rloo", "R - mean of the group's other samples, one per sample", _per_sample(rloo)))
register(
    Estimator(
        "reinforce_pp",
        "REINFORCE++ baseline: R - group mean, discounted per token, whitened over the global batch",
        reinforce_pp,
        per_token=True,
    )
)
register(
    Estimator(
        "gae",
        "PPO with a critic: GAE over a value model trained alongside the policy",
        gae,
        per_token=True,
        critic=True,
    )
)
