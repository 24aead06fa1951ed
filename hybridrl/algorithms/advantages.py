"""Advantage estimators, the KL-in-reward penalty and the critic's loss: pure functions, chosen by name.

Two kinds of estimator:
- one advantage per sample, from its group of n ([P, n] rewards): grpo, dr_grpo, rloo;
- one per completion token ([B, T], laid out like `Batch.loss_mask`, rows in group order, the
  sample's reward on its last completion token): reinforce_pp, gae.

`ADVANTAGES[name](Experience)` gives (advantages, returns); `estimate(cfg, rewards, batch)` builds
the Experience from a rollout batch. The policy loss itself (clipped surrogate, KL in the loss,
aggregation) lives in kernels/ppo_loss.py. Definitions and derivations: docs/losses.md.

KL in the reward (`algo.kl_in=reward`), as in OpenRLHF: each completion token gets the reward
-beta * KL_t, KL_t from `algo.kl_type` on d = logp_ref - logp_old (the trainer's log-probs of the
sampling policy, so the KL is exactly 0 while policy == reference). The token-level estimators
use it as it is. Departure from OpenRLHF for the group estimators: OpenRLHF adds the per-token
penalty after the group baseline (so a token's advantage is (R - mean) - beta * sum_{s>=t} KL_s);
here beta * sum_t KL_t is taken off the sample's reward BEFORE the group baseline, so that those
estimators stay one-number-per-sample and the baseline (and GRPO's std) see the penalised reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridrl.core.launch import all_sum
from hybridrl.kernels.ppo_loss import KL_ESTIMATORS

if TYPE_CHECKING:
    from hybridrl.core.config import AlgoConfig
    from hybridrl.data.batch import Batch

EPS = 1e-6


# --- one advantage per sample, from its group: [P, n] -> [P, n] --------------------------------
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (R - group mean) / (group std + eps).

    The std is torch's default unbiased estimator, as in TRL and verl, so numbers match theirs.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + EPS)  # [P, n]


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): R - group mean; no std division (it favours easy/hard groups)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): R_i - mean of the other n-1 samples of the group."""
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * n / (n - 1)


GROUP_ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}  # name -> fn


def advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """rewards [P, n] -> advantages [P, n] of a group estimator. Groups with equal rewards get exactly 0."""
    return GROUP_ESTIMATORS[name](rewards.float())


# --- the token-level pieces ----------------------------------------------------------------------
@dataclass
class Experience:
    """What an estimator may read. Token tensors are [B, T] like Batch.loss_mask, B = P * n."""
    rewards: torch.Tensor  # [P, n] the task's rewards
    mask: torch.Tensor  # [B, T] bool, completion tokens
    kl: torch.Tensor | None = None  # [B, T] beta * KL_t when the KL is in the reward, else None
    values: torch.Tensor | None = None  # [B, T] the critic's values before this update (gae)
    gamma: float = 1.0
    lam: float = 1.0


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kl_type: str,
               coef: float) -> torch.Tensor:
    """coef * KL_t per completion token [B, T] (0 elsewhere), with the loss's estimators and clamps."""
    d = (logp_ref - logp).clamp(-20.0, 20.0)  # [B, T]
    return torch.where(mask, coef * KL_ESTIMATORS[kl_type](d), 0.0)


def token_rewards(seq_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None) -> torch.Tensor:
    """The sample's reward on its last completion token, minus the KL penalty on every token: [B, T]."""
    last = mask & (mask.cumsum(1) == mask.sum(1, keepdim=True))  # [B, T] one True per non-empty row
    r = torch.where(last, seq_rewards[:, None].to(torch.float32), 0.0)
    return r if kl is None else r - kl


def discounted_returns(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} along each row's completion, 0 elsewhere: [B, T]. t + 1 is the
    next masked token: a multi-turn episode's environment tokens are skipped, not steps."""
    out, g = torch.zeros_like(r), torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        g = torch.where(mask[:, t], r[:, t] + gamma * g, g)  # carried across unmasked tokens
        out[:, t] = torch.where(mask[:, t], g, 0.0)
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + eps) over the completion tokens of the WHOLE global batch (every rank's
    rows: two all-reduces), population std as in OpenRLHF; 0 off the mask. [B, T]."""
    m = mask.to(torch.float64)
    x64 = x.to(torch.float64)
    total, n = all_sum([float((x64 * m).sum()), float(m.sum())])
    mean = total / max(n, 1.0)
    (sq,) = all_sum([float((((x64 - mean) * m) ** 2).sum())])
    std = math.sqrt(sq / max(n, 1.0))
    return torch.where(mask, ((x64 - mean) / (std + EPS)).to(x.dtype), 0.0)


# --- estimators by name: Experience -> (advantages [B] or [B, T], returns [B, T] or None) ---------
def _per_sample(fn):
    def estimate(x: Experience):
        R = x.rewards if x.kl is None else x.rewards - x.kl.sum(1).view_as(x.rewards)  # see the module docstring
        return fn(R).flatten(), None  # [B]
    estimate.__doc__ = f"{fn.__name__} on R - beta * sum_t KL_t (when the KL is in the reward): [B]."
    return estimate


def reinforce_pp(x: Experience) -> tuple[torch.Tensor, None]:
    """REINFORCE++ with baseline (Hu et al. 2025, "REINFORCE++"; OpenRLHF's reinforce_baseline):
    token reward = (R - group mean) on the last token, - beta * KL_t on each; discounted returns;
    then whitened over every completion token of the global batch (all ranks). [B, T]

    Note: whitening shifts a group whose rewards are all equal away from 0 (by -mean / std), so
    algo.skip_zero_advantage rarely skips a sample here, as in OpenRLHF.
    """
    base = (x.rewards - x.rewards.mean(dim=1, keepdim=True)).flatten()  # [B]
    returns = discounted_returns(token_rewards(base, x.mask, x.kl), x.mask, x.gamma)  # [B, T]
    return whiten(returns, x.mask), None


def gae(x: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) for PPO with a critic.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0); A_t = delta_t + gamma *
    lambda * A_{t+1}; returns R_t = A_t + V_t (the critic's target). r_t is the sample's reward on
    its last token minus the KL penalty. t + 1 is the next masked token (a multi-turn episode's
    environment tokens are not steps: verl's multi-turn GAE does the same). The advantages are then
    whitened over the global batch (OpenRLHF and verl do the same); the returns are not. ([B, T], [B, T])
    """
    r = token_rewards(x.rewards.flatten(), x.mask, x.kl)  # [B, T]
    v = torch.where(x.mask, x.values.float(), 0.0)  # [B, T]
    adv, last, nxt = torch.zeros_like(v), torch.zeros(v.shape[0]), torch.zeros(v.shape[0])
    for t in reversed(range(v.shape[1])):  # nxt, last: of the next masked token (0 after a row's last)
        m = x.mask[:, t]
        a = r[:, t] + x.gamma * nxt - v[:, t] + x.gamma * x.lam * last
        last, nxt = torch.where(m, a, last), torch.where(m, v[:, t], nxt)  # environment tokens are skipped
        adv[:, t] = torch.where(m, a, 0.0)
    return whiten(adv, x.mask), adv + v


ADVANTAGES = {**{k: _per_sample(fn) for k, fn in GROUP_ESTIMATORS.items()},
              "reinforce_pp": reinforce_pp, "gae": gae}  # name -> fn(Experience)


def estimate(a: AlgoConfig, rewards: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                            dict[str, float]]:
    """Advantages ([B] or [B, T]), returns (gae) and metrics for a rollout batch whose rows are the
    samples of `rewards` [P, n] in order; the batch carries logp_ref and logp_old when the KL is in
    the reward, values for gae."""
    kl = None
    if a.kl_coef and a.kl_in == "reward":
        kl = kl_penalty(batch.logp_old, batch.logp_ref, batch.loss_mask, a.kl_type, a.kl_coef)
    x = Experience(rewards.float(), batch.loss_mask, kl, batch.values, a.gamma, a.gae_lambda)
    adv, returns = ADVANTAGES[a.advantage](x)
    tok = adv if adv.dim() == 2 else adv[:, None].expand(batch.loss_mask.shape)
    s = all_sum([float(tok[batch.loss_mask].abs().sum()), float(batch.loss_mask.sum()),
                 float(kl.sum()) if kl is not None else 0.0])
    metrics = {"adv_abs_mean": s[0] / max(s[1], 1.0)}
    if kl is not None:
        metrics["kl_reward"] = s[2] / max(s[1], 1.0)  # mean beta * KL_t per completion token
    return adv, returns, metrics


def nonzero_advantage(adv: torch.Tensor) -> torch.Tensor:
    """[B] bool: the samples whose advantage is not 0 (on some token): those that carry a policy
    gradient. (dapo.mixed_groups is the group-level question asked before advantages exist.)"""
    return adv != 0 if adv.dim() == 1 else (adv != 0).any(dim=1)


# --- the critic's loss ------------------------------------------------------------------------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float,
               normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017; OpenAI baselines ppo2, OpenRLHF ValueLoss),
    token tensors flat [N]:

        sum_t 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2) / normalizer

    clip = 0 turns clipping off (0.5 * (V - R)^2). The normaliser is explicit (the global token
    count of the minibatch) so micro-batch losses sum to the minibatch's, as in ppo_loss.
    """
    plain = (values - returns) ** 2  # [N]
    if clip:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        per_tok = torch.maximum(plain, clipped)
        frac = (clipped > plain).float().mean() if len(values) else values.new_zeros(())
    else:
        per_tok, frac = plain, values.new_zeros(())
    loss = 0.5 * per_tok.sum() / max(normalizer, 1.0)
    return loss, {"value_clip_frac": frac.detach(), "value_mean": values.detach().mean() if len(values) else frac,
                  "return_mean": returns.mean() if len(values) else frac}
