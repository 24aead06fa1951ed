"""The advantage estimators applied to a rollout batch, the KL-in-reward penalty and the critic's loss.

The estimators themselves are pure functions declared in estimators.py (`ADVANTAGES[name](Experience)`
gives (advantages, returns)); `estimate(cfg, rewards, batch, all_sum=...)` builds the Experience
from a rollout batch, with the all-reduce whitening needs passed in by the caller (launch.all_sum in
a run), so the math stays a function of its tensors and imports nothing distributed. The policy
loss itself (clipped surrogate, KL in the loss, aggregation) lives in kernels/ppo_loss.py.
Definitions and derivations: docs/losses.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from hybridrl.algorithms import distill
from hybridrl.algorithms.estimators import (
    EPS,
    GROUP_ESTIMATORS,
    Experience,
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    reinforce_pp,
    rloo,
    token_rewards,
    whiten,
)
from hybridrl.algorithms.kl import KL_ESTIMATORS
from hybridrl.algorithms.registry import ESTIMATORS, estimator

if TYPE_CHECKING:
    from hybridrl.core.config import AlgoConfig


class Rollout(Protocol):
    """What `estimate` reads of a rollout batch (data.batch.Batch, a floor up): [B, T] token tensors."""

    loss_mask: torch.Tensor
    logp_rollout: torch.Tensor
    logp_old: torch.Tensor | None
    logp_ref: torch.Tensor | None
    logp_teacher: torch.Tensor | None
    values: torch.Tensor | None


ADVANTAGES = {name: spec.fn for name, spec in ESTIMATORS.items()}  # name -> fn(Experience)


def advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """rewards [P, n] -> advantages [P, n] of a group estimator. Groups with equal rewards get exactly 0."""
    return GROUP_ESTIMATORS[name](rewards.float())


def kl_penalty(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kl_type: str, coef: float
) -> torch.Tensor:
    """coef * KL_t per completion token [B, T] (0 elsewhere), with the loss's estimators and clamps."""
    d = (logp_ref - logp).clamp(-20.0, 20.0)  # [B, T]
    return torch.where(mask, coef * KL_ESTIMATORS[kl_type](d), 0.0)


def estimate(
    a: AlgoConfig,
    rewards: torch.Tensor,
    batch: Rollout,
    *,
    all_sum: Callable[[list[float]], list[float]],
    all_max: Callable[[float], float] = float,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Advantages ([B] or [B, T]), returns (gae) and metrics for a rollout batch whose rows are the
    samples of `rewards` [P, n] in order; the batch carries logp_ref and logp_old when the KL is in
    the reward, values for gae. `all_sum` sums a list over every rank (launch.all_sum; identity on
    one rank): whitening and the metrics are over the global batch. It has no default, so a
    multi-rank caller cannot forget it and whiten each rank's share on its own. `all_max` (launch.all_max)
    gives a metric's largest value over the ranks (by default this rank's)."""
    kl = None
    if a.kl_coef and a.kl_in == "reward":
        kl = kl_penalty(batch.logp_old, batch.logp_ref, batch.loss_mask, a.kl_type, a.kl_coef)
    task = rewards.float() if a.task_reward else torch.zeros_like(rewards, dtype=torch.float32)
    x = Experience(task, batch.loss_mask, kl, batch.values, a.gamma, a.gae_lambda, all_sum)
    adv, returns = estimator(a.advantage).fn(x)
    d = None
    if batch.logp_teacher is not None:  # distillation: the teacher's per-token reverse KL (distill.py)
        student = batch.logp_old if batch.logp_old is not None else batch.logp_rollout
        coef = a.distill_coef if a.distill_loss == "sampled" else 0.0  # full: the loss carries the teacher
        adv, d = distill.token_advantages(adv, student, batch.logp_teacher, batch.loss_mask, coef)
    tok = adv if adv.dim() == 2 else adv[:, None].expand(batch.loss_mask.shape)
    s = all_sum(
        [
            float(tok[batch.loss_mask].abs().sum()),
            float(batch.loss_mask.sum()),
            float(kl.sum()) if kl is not None else 0.0,
            float(d.sum()) if d is not None else 0.0,
        ]
    )
    metrics = {"adv_abs_mean": s[0] / max(s[1], 1.0)}
    if kl is not None:
        metrics["kl_reward"] = s[2] / max(s[1], 1.0)  # mean beta * KL_t per completion token
    if d is not None:  # the mean and the largest over every rank's tokens
        metrics["teacher_kl"] = s[3] / max(s[1], 1.0)
        metrics["teacher_kl_max"] = all_max(float(d[batch.loss_mask].max()) if batch.loss_mask.any() else -1e30)
    return adv, returns, metrics


def nonzero_advantage(adv: torch.Tensor) -> torch.Tensor:
    """[B] bool: the samples whose advantage is not 0 (on some token): those that carry a policy
    gradient. (dapo.mixed_groups is the group-level question asked before advantages exist.)"""
    return adv != 0 if adv.dim() == 1 else (adv != 0).any(dim=1)


def gradient_without_advantage(a) -> bool:
    """The loss has a term that reaches every sample whatever its advantage (the KL in the loss, the
    full-vocabulary distillation divergence): no sample may be skipped for a zero advantage."""
    return bool(a.kl_coef and a.kl_in == "loss") or bool(a.teacher and a.distill_loss == "full")


# --- the critic's loss ------------------------------------------------------------------------
def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float, normalizer: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    return loss, {
        "value_clip_frac": frac.detach(),
        "value_mean": values.detach().mean() if len(values) else frac,
        "return_mean": returns.mean() if len(values) else frac,
    }
